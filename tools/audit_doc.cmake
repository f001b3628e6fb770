cmake_minimum_required(VERSION 3.16)  # policies: @VAR@ in quoted strings is literal (CMP0053)
# Generates docs/audit-elementwise-rope.md from its template and the status matrices that
# `samebits verify` writes (docs/status/<backend>.md), so that a verdict in the audit can never
# differ from the harness run it cites. With CHECK=<committed doc> it fails if the committed
# document differs from what it would generate (a CTest: docs.audit_is_current). FAIL_OP=<op> makes
# the op's first cell read FAIL (the CTest that proves the check can fail).
#   cmake -DTEMPLATE=docs/audit/elementwise-rope.in.md -DSTATUS=docs/status
#         -DOUT=docs/audit-elementwise-rope.md [-DCHECK=docs/audit-elementwise-rope.md] -P tools/audit_doc.cmake
set(OPS rope qk_norm_rope swiglu residual_add add_rmsnorm)

# The op summary row and the case rows of the audited ops in one backend's matrix, with a verdict.
function(audit_rows backend out_var)
  set(file ${STATUS}/${backend}.md)
  if(NOT EXISTS ${file})
    set(${out_var} "(no ${backend} status matrix committed)" PARENT_SCOPE)
    return()
  endif()
  file(STRINGS ${file} lines)
  if(DEFINED FAIL_OP)  # test hook: pretend the harness failed this op's forward invariance
    string(REGEX REPLACE "\\| ${FAIL_OP} \\| ([0-9]+) \\| PASS" "| ${FAIL_OP} | \\1 | FAIL" lines "${lines}")
  endif()
  set(text "| op | verdict | forward invariance | forward accuracy | backward invariance | backward accuracy | cases |\n")
  string(APPEND text "| --- | --- | --- | --- | --- | --- | --- |\n")
  set(cases "")
  foreach(op ${OPS})
    foreach(line ${lines})
      if(line MATCHES "^\\| ${op} \\| ([0-9]+) \\| (.*) \\|$")
        set(n ${CMAKE_MATCH_1})
        set(cells ${CMAKE_MATCH_2})
        if(cells MATCHES "FAIL")
          set(verdict "**NEEDS FIX**")
        elseif(cells MATCHES "NOT BUILT")
          set(verdict "not built")
        else()
          set(verdict "pass")
        endif()
        string(APPEND text "| ${op} | ${verdict} | ${cells} | ${n} |\n")
      elseif(line MATCHES "^\\| ${op} [^|]*\\| ")
        string(APPEND cases "${line}\n")
      endif()
    endforeach()
  endforeach()
  string(APPEND text "\n| case | fwd inv (checks) | fwd acc | bwd inv (checks) | bwd acc |\n| --- | --- | --- | --- | --- |\n${cases}")
  set(${out_var} "${text}" PARENT_SCOPE)
endfunction()

audit_rows(cpu CPU_ROWS)
audit_rows(cuda CUDA_ROWS)
file(READ ${TEMPLATE} template)
string(REPLACE "@CPU_ROWS@" "${CPU_ROWS}" doc "${template}")
string(REPLACE "@CUDA_ROWS@" "${CUDA_ROWS}" doc "${doc}")
if(DEFINED CHECK)
  file(READ ${CHECK} committed)
  if(NOT doc STREQUAL committed)
    message(FATAL_ERROR "docs/audit-elementwise-rope.md is stale: regenerate it with `cmake -DTEMPLATE="
                        "docs/audit/elementwise-rope.in.md -DSTATUS=docs/status -DOUT=docs/audit-elementwise-rope.md "
                        "-P tools/audit_doc.cmake`")
  endif()
else()
  file(WRITE ${OUT} "${doc}")
endif()

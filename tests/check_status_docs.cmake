# Regenerates the CPU status matrix and fails if docs/status/cpu.md differs from it.
execute_process(COMMAND ${SAMEBITS} verify --backend cpu --quiet --status-dir ${OUT}
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "samebits verify failed (exit ${rc})")
endif()
file(READ ${OUT}/cpu.md fresh)
file(READ ${DOCS}/cpu.md committed)
if(NOT fresh STREQUAL committed)
  message(FATAL_ERROR "docs/status/cpu.md is stale: regenerate it with "
                      "`samebits verify --backend cpu --status-dir docs/status`")
endif()

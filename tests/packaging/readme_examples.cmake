# ctest docs.readme_examples: what the README says about its example input holds.
#  - examples/seqs.jsonl scores with the built-in model (`samebits logprobs --input ...`, one output
#    line per input line; its loss_mask line leaves the masked tokens null), and the vocab size the
#    README gives ("the built-in model (... vocab N") is the built-in model's (`samebits inspect`);
#  - `samebits grads`: the same bits for any --micro-batch, other bits for the sequences reversed
#    (a sum in sequence order).
#   cmake -DSAMEBITS=build/samebits -DSOURCE=. -DWORK=DIR -P readme_examples.cmake
include(${CMAKE_CURRENT_LIST_DIR}/script_util.cmake)
require_vars(readme_examples.cmake SAMEBITS SOURCE WORK)

set(example ${SOURCE}/examples/seqs.jsonl)
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
file(READ ${SOURCE}/README.md readme)
if(NOT readme MATCHES "examples/seqs\\.jsonl")
  message(FATAL_ERROR "README.md does not name examples/seqs.jsonl")
endif()
if(NOT readme MATCHES "the built-in model \\([^)]*vocab ([0-9]+)")
  message(FATAL_ERROR "README.md does not give the built-in model's vocab size: \"the built-in model (... vocab N\"")
endif()
set(readme_vocab ${CMAKE_MATCH_1})
run("samebits inspect" ${SAMEBITS} inspect)
if(NOT out MATCHES "vocab ([0-9]+)" OR NOT CMAKE_MATCH_1 STREQUAL readme_vocab)
  message(FATAL_ERROR "README.md says vocab ${readme_vocab}; samebits inspect says:\n${out}")
endif()

file(STRINGS ${example} lines)
list(LENGTH lines n_in)
run("samebits logprobs --input examples/seqs.jsonl" ${SAMEBITS} logprobs --input ${example})
string(REGEX MATCHALL "[^\n]+" scored "${out}")
list(LENGTH scored n_out)
if(n_in LESS 2 OR NOT n_in EQUAL n_out)
  message(FATAL_ERROR "examples/seqs.jsonl: ${n_in} lines in, ${n_out} out:\n${out}")
endif()
set(masked 0)
foreach(i RANGE 1 ${n_in})
  math(EXPR k "${i} - 1")
  list(GET lines ${k} line)
  list(GET scored ${k} result)
  if(line MATCHES "\"loss_mask\": *\\[0, *0, *0, *0, *1")  # the README's masked example
    if(NOT result MATCHES "^{\"logprobs\": *\\[null, *null, *null, *null, *-")
      message(FATAL_ERROR "examples/seqs.jsonl line ${i}: masked tokens scored: ${result}")
    endif()
    set(masked 1)
  endif()
endforeach()
if(NOT masked)
  message(FATAL_ERROR "examples/seqs.jsonl has no line with loss_mask [0, 0, 0, 0, 1, ...]")
endif()

# Gradients: a sum over the sequences in their order, whatever the micro-batches.
run("samebits export-model" ${SAMEBITS} export-model ${WORK}/model)
list(REVERSE lines)
string(JOIN "\n" reversed ${lines})
file(WRITE ${WORK}/reversed.jsonl "${reversed}\n")
foreach(job "mb1;${example};1" "mb2;${example};2" "mb16;${example};16" "reversed;${WORK}/reversed.jsonl;1")
  list(GET job 0 name)
  list(GET job 1 input)
  list(GET job 2 micro)
  run("samebits grads (${name})" ${SAMEBITS} grads --model ${WORK}/model --input ${input}
      --output ${WORK}/${name}.safetensors --micro-batch ${micro})
  file(SHA256 ${WORK}/${name}.safetensors sha_${name})
endforeach()
if(NOT sha_mb1 STREQUAL sha_mb2 OR NOT sha_mb1 STREQUAL sha_mb16)
  message(FATAL_ERROR "samebits grads: the bits depend on --micro-batch")
endif()
if(sha_mb1 STREQUAL sha_reversed)
  message(FATAL_ERROR "samebits grads: the sequences reversed gave the same bits: is the README's "
                      "\"depend on the order of the sequences\" still true?")
endif()
file(REMOVE_RECURSE ${WORK})

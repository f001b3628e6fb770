# Writes the text file IN as a C++ string constant into OUT (used for docs/contract.json).
file(READ ${IN} text)
set(delim "samebits_json")
file(WRITE ${OUT} "// Generated from ${IN}; do not edit.\nnamespace samebits::harness { extern const char* const kEmbeddedContractJson; const char* const kEmbeddedContractJson = R\"${delim}(${text})${delim}\"; }\n")

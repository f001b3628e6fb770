// The built-in case registry: every op of the chain, several shapes and dtypes each.
#include "samebits/harness.hpp"

namespace samebits::harness {

void add_linear_norm_cases(CaseList&);
void add_pointwise_cases(CaseList&);
void add_embedding_cases(CaseList&);
void add_attention_logprob_cases(CaseList&);

CaseList builtin_cases() {
  CaseList cases;
  add_linear_norm_cases(cases);
  add_pointwise_cases(cases);
  add_embedding_cases(cases);  // after the pointwise cases: the status matrix keeps its row order
  add_attention_logprob_cases(cases);
  return cases;
}

}  // namespace samebits::harness

// Scores one sequence with the built-in model on the CPU backend, alone and packed after another
// sequence, and checks that its logprobs are the same bits both ways. Exits 0 when they are.
#include <samebits/chain.hpp>

#include <cstdio>
#include <cstring>
#include <vector>

int main() {
  using namespace samebits;
  const Model model = Model::builtin(/*tied=*/false);
  const Chain chain(model, Context{});  // CPU backend, fixed-order fp32

  const std::vector<int32_t> seq = {1, 2, 3, 4};
  const ChainForward alone = chain.forward(ChainBatch::packed({seq}));
  const ChainForward packed = chain.forward(ChainBatch::packed({{7, 8, 9}, seq}));  // seq at rows 3..6

  // Row i scores token i + 1 given tokens 0 .. i; the last token scores nothing.
  for (size_t i = 0; i + 1 < seq.size(); ++i) {
    const double a = alone.logp[i], b = packed.logp[3 + i];
    std::printf("log p(token %zu = %d) = %.9g\n", i + 1, seq[i + 1], a);
    if (std::memcmp(&a, &b, sizeof a) != 0 || !(a < 0)) {
      std::fprintf(stderr, "consumer: row %zu: %.17g alone, %.17g packed\n", i, a, b);
      return 1;
    }
  }
  std::printf("consumer: samebits %s, same bits alone and packed\n", cuda_backend_built() ? "(cpu, cuda)" : "(cpu)");
  return 0;
}

// Every CPU op's backward (fp64 truth mode) agrees with central finite differences of its forward.
#include <gtest/gtest.h>

#include "samebits/harness.hpp"

using namespace samebits::harness;

class FiniteDifferences : public ::testing::TestWithParam<std::shared_ptr<const OpCase>> {};

TEST_P(FiniteDifferences, BackwardMatchesForward) {
  const auto failures = check_gradients_fd(*GetParam(), FdOptions{});
  for (auto& d : failures) ADD_FAILURE() << d.tensor << ": " << d.first_index_text;
}

INSTANTIATE_TEST_SUITE_P(AllCases, FiniteDifferences, ::testing::ValuesIn(builtin_cases()),
                         [](const auto& info) {
                           std::string n = info.param->name();
                           for (auto& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n + "_" + std::to_string(info.index);
                         });

// Test helpers for the model chain: the built-in model's shape as a Llama-3 model.
#pragma once
#include "samebits/model.hpp"

namespace samebits::testing_model {

// Llama-3 (no QK-norm, untied, Llama-3 RoPE scaling) with the built-in model's shape; the original
// context is small so the scaling bands fall inside head_dim.
inline ModelConfig builtin_llama_config() {
  ModelConfig c = Model::builtin(false).config();
  c.architecture = "llama";
  c.qk_norm = false;
  c.rope.theta = 500000.0;
  c.rope.llama3_scaling = true;
  c.rope.original_max_position = 64;
  return c;
}

}  // namespace samebits::testing_model

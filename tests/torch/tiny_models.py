"""What the GPU tests of tests/torch share: the raw bits of a tensor, and small random transformers
models (Qwen3, Llama-3) made on the GPU. Imported by test modules after their torch / CUDA checks."""
import torch

DEV = "cuda"


def bits(t):
    return t.detach().contiguous().view(torch.uint8).cpu()


def qwen3(transformers, vocab, hidden, mlp, heads, kv_heads, head_dim, tied):
    """A random 2-layer transformers Qwen3 model in bf16, made on the GPU."""
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                   max_position_embeddings=512, tie_word_embeddings=tied)
    with torch.device(DEV):
        return transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()


def llama3(transformers, vocab, hidden, mlp, heads, kv_heads, head_dim):
    """A random 2-layer transformers Llama model with Llama-3 RoPE scaling, bf16, on the GPU."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                   max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    with torch.device(DEV):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()

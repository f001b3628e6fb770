"""samebits.hf.patch: a transformers Qwen3 / Llama model that runs samebits' ops, in the model chain's
order, inside its own modules.

    model = samebits.hf.patch(model)                  # in place; returns the model
    logps = model.token_logprobs(sequences)           # per sequence [len - 1], differentiable
    logp, entropy = model(input_ids, lengths)         # the packed door: one row a token

Why it is shaped this way. samebits.hf.Scorer runs the C++ chain beside the module: nothing of
PyTorch's training machinery reaches it. Here the model stays an ordinary nn.Module whose own
forwards call samebits.torch ops (each a torch custom op with its own backward), so FSDP2
(fully_shard on the decoder layers and the root), DDP, activation checkpointing, hooks and
optimizers apply as to the stock model. The forwards are the chain's, step for step: the embedding;
per layer the input norm (fused with the residual add from the second layer on), q / k / v, QK-norm
fused with RoPE (Qwen3) or RoPE (Llama), packed causal attention, o, the residual add fused with the
post-attention norm, gate / up, SwiGLU, down; the final residual add fused with the final norm; the
LM head fused with the selected logprob. Each op's bits are the chain's op's (the same kernels, and a
row's bits never depend on the other rows), so the logprobs equal Chain.logprobs,
Scorer.token_logprobs and the generation engine's bit for bit.

A decoder layer's forward takes and returns the residual stream as a pair (down, x_mid) of the
packed rows [T, hidden]: the add that joins them is fused with the next layer's input norm, as in
the chain, so each layer owns its own norm's weight (FSDP2 shards a layer with its weights).
Sequences are packed back to back (no padding): `lengths` gives them, positions restart at 0 in
each. Weight gradients are those of the ops' own backwards (fp32 accumulators rounded once to the
parameter's dtype a call): within fp32 rounding of the chain's backward, which sums a whole batch's
terms before one rounding.

What the patched forwards bypass: the submodules' own calls (q_proj, mlp, embed_tokens, norm,
lm_head, …) — their hooks do not fire, an adapter that wraps them (PEFT LoRA) is not applied, and an
FSDP2 unit must be a decoder layer or the root (a unit on embed_tokens or lm_head alone would be
read sharded). Activation checkpointing: torch's (`torch.distributed._composable.checkpoint`, or
wrappers applied after patch) or transformers' gradient_checkpointing_enable where its decoder
layers are GradientCheckpointingLayers; a wrapper applied before patch has its forward replaced.
"""
import types

import torch

from . import _core
from . import torch as sbt
from .torch import _common
from .torch import ops as sbt_ops


class _Shape:
    """What a patched layer reads besides its weights: the chain's view of the model's config."""

    def __init__(self, config):
        self.eps = float(config["rms_norm_eps"])
        self.qk_norm = bool(config["qk_norm"])
        self.theta = float(config["rope_theta"])
        self.rope_scaling = config["rope_scaling"]
        self.heads, self.kv_heads, self.head_dim = config["num_heads"], config["num_kv_heads"], config["head_dim"]


def _config(hf_model):
    """The transformers config as the C++ chain reads it (the same parser: same eps, RoPE, sizes)."""
    from .hf import _config_json  # here, not at the top: samebits.hf imports this module
    return _core.config_of_json(_config_json(hf_model, next(hf_model.parameters()).dtype))


def _acc(module, weight, lengths):
    """The keyword arguments that make an op accumulate `weight`'s gradient into its main_grad
    (patch(main_grad=True)), segment by segment over the packed sequences; none otherwise."""
    if not getattr(module, "_samebits_main_grad", False):
        return {}
    return {"main_grad": weight.main_grad, "segments": lengths}


def _linear(x, module, owner, lengths):
    return sbt.linear(x, module.weight, module.bias, **_acc(owner, module.weight, lengths))


def _layer_forward(self, x, residual, positions, lengths):
    """One decoder layer, the chain's ops in the chain's order. x: the previous layer's down
    projection (or the embedding's rows when residual is None), residual: its x_mid. Returns this
    layer's (down, x_mid)."""
    c = self._samebits_shape
    norm1 = self.input_layernorm.weight
    if residual is None:  # the first layer: its input norm over the embedding's rows
        n1, x_in = sbt.rms_norm(x, norm1, c.eps, **_acc(self, norm1, lengths)), x
    else:
        n1, x_in = sbt.add_rms_norm(x, residual, norm1, c.eps, **_acc(self, norm1, lengths))
    attn, T = self.self_attn, n1.shape[0]
    q = _linear(n1, attn.q_proj, self, lengths).view(T, c.heads, c.head_dim)
    k = _linear(n1, attn.k_proj, self, lengths).view(T, c.kv_heads, c.head_dim)
    v = _linear(n1, attn.v_proj, self, lengths).view(T, c.kv_heads, c.head_dim)
    if c.qk_norm:  # Qwen3: QK-norm fused with RoPE
        qn, kn = attn.q_norm.weight, attn.k_norm.weight
        q = sbt.qk_norm(q, qn, c.eps, positions, c.theta, c.rope_scaling, **_acc(self, qn, lengths))
        k = sbt.qk_norm(k, kn, c.eps, positions, c.theta, c.rope_scaling, **_acc(self, kn, lengths))
    else:
        q = sbt.rope(q, positions, c.theta, c.rope_scaling)
        k = sbt.rope(k, positions, c.theta, c.rope_scaling)
    o = _linear(sbt.attention(q, k, v, lengths).reshape(T, c.heads * c.head_dim), attn.o_proj, self, lengths)
    norm2 = self.post_attention_layernorm.weight
    n2, x_mid = sbt.add_rms_norm(o, x_in, norm2, c.eps, **_acc(self, norm2, lengths))
    mlp = self.mlp
    gate, up = _linear(n2, mlp.gate_proj, self, lengths), _linear(n2, mlp.up_proj, self, lengths)
    down = _linear(sbt.swiglu(gate, up), mlp.down_proj, self, lengths)
    return down, x_mid


def _packed(input_ids, lengths, device, vocab):
    """The lengths as a list of ints, int32 ids [T], positions [T] (restarting at 0 in each sequence)
    and targets [T] (the next token of the same sequence; -100 on each sequence's last row: not
    scored), on `device`, and whether the ids were checked against `vocab` here (ids in host memory
    are: the embedding then skips its own check, which waits for the GPU). Nothing here waits for
    the GPU: the positions go up in one copy from page-locked memory, and the targets are made from
    them on the device."""
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1:
        raise _core.Error("samebits.hf.patch: lengths: every sequence needs at least one token")
    ids = input_ids.reshape(-1)
    if ids.numel() != sum(lengths):
        raise _core.Error(f"samebits.hf.patch: input_ids holds {ids.numel()} tokens, lengths sum to {sum(lengths)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise _core.Error(f"samebits.hf.patch: input_ids: dtype {ids.dtype} is not taken (int32 or int64)")
    checked = ids.device.type == "cpu" and torch.device(device).type == "cuda"
    if checked:
        bad = ((ids < 0) | (ids >= vocab)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise _core.Error(f"samebits.hf.patch: input_ids: value {int(ids[i])} at index {i} is outside [0, {vocab})")
        ids = ids.to(torch.int32)  # in range: narrowed on the host, half the bytes to copy
    ids = ids.to(device)
    if ids.dtype == torch.int64:  # int32 for the targets made from them (as samebits.torch narrows int64 targets):
        ids = ids.clamp(-2**31, 2**31 - 1)  # a value outside int32 clamped to its nearest bound, outside every
        # vocab, which the embedding names
    ids = ids.to(torch.int32).contiguous()
    lens = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    positions = torch.arange(ids.numel(), dtype=torch.int64) - torch.repeat_interleave(starts, lens)
    positions = positions.to(torch.int32)
    if ids.is_cuda:
        positions = positions.pin_memory().to(device, non_blocking=True)
    last = torch.ones_like(positions, dtype=torch.bool)  # a sequence's last row: the next one starts at 0
    last[:-1] = positions[1:] == 0
    targets = torch.roll(ids, -1)
    targets.masked_fill_(last, -100)
    return lengths, ids, positions, targets, checked


def _model_forward(self, input_ids, lengths):
    """(logp, entropy) float32 [T] of each packed row's next token (0 on each sequence's last row)."""
    inner = self.model
    c = self._samebits_shape
    device = inner.embed_tokens.weight.device
    # The layers get the lengths as the checked list (a tensor or a generator would be walked again
    # in every layer, a CUDA tensor with a synchronisation per sequence).
    table = inner.embed_tokens.weight
    lengths, ids, positions, targets, checked = _packed(input_ids, lengths, device, table.shape[0])
    acc = {"main_grad": table.main_grad} if self._samebits_main_grad else {}  # token order: no segments needed
    embed = sbt_ops._embedding_of_checked_ids if checked else sbt.embedding
    x, residual = embed(ids, table, **acc), None
    for layer in inner.layers:
        x, residual = layer(x, residual, positions, lengths)
    hidden, _ = sbt.add_rms_norm(x, residual, inner.norm.weight, c.eps, **_acc(self, inner.norm.weight, lengths))
    head = self.lm_head.weight
    acc = _acc(self, head, lengths)
    if acc and head is table:  # tied: the LM head's sum in a buffer of its own (reduce_main_grad adds it)
        acc["main_grad"] = head.main_grad_lm_head
    if head.shape[0] >= table.shape[0]:  # the targets are ids checked above (on the host, or by the embedding)
        return sbt_ops._lm_head_logprobs_of_checked_targets(hidden, head, targets,
                                                            keep_logits_bytes=self._samebits_keep_logits_bytes, **acc)
    return sbt.lm_head_logprobs(hidden, head, targets, keep_logits_bytes=self._samebits_keep_logits_bytes, **acc)


def _token_logprobs(self, sequences, entropy: bool = False):
    """Per sequence a float32 tensor [len - 1]: log p(token i | tokens < i) for i = 1 … len - 1 (bit
    for bit Scorer.token_logprobs'), differentiable; with entropy, also the entropies."""
    seqs = [torch.as_tensor(s).reshape(-1) for s in sequences]
    if not seqs:
        raise _core.Error("samebits.hf.patch: token_logprobs: no sequences")
    lengths = [int(s.numel()) for s in seqs]
    logp, ent = self(torch.cat(seqs), lengths)
    # Each sequence's rows but its last (which has no next token): views of the packed result.
    logps = [x[:-1] for x in logp.split(lengths)]
    return (logps, [x[:-1] for x in ent.split(lengths)]) if entropy else logps


def patch(hf_model, main_grad: bool = False, keep_logits_bytes: int = 0):
    """Make a transformers Qwen3 / Llama causal LM (on the GPU or the CPU, bf16 / fp16 / fp32) run
    samebits' ops in the chain's order inside its own modules; in place. The model's forward
    becomes model(input_ids, lengths) -> (logp, entropy) over packed rows, and
    model.token_logprobs(sequences) gives per-sequence logprobs. Raises samebits.Error on a model
    the chain does not take (another architecture, biases, RoPE scaling other than Llama-3's).

    main_grad=True: every parameter gets an fp32 `main_grad` (zeros; the convention of Megatron /
    Transformer Engine) that each backward adds its gradient into, segment by segment over the
    packed sequences, leaving `.grad` None — a step's gradient bits then do not depend on how its
    sequences are split into micro-batches (at sequence boundaries). Zero them between steps
    yourself. With tied word embeddings the LM head's part goes to a second buffer,
    `main_grad_lm_head` (the chain keeps the two apart too: one buffer would take the two sums in
    an order set by the split); reduce_main_grad(model) adds it in, once a step, after the last
    backward. Needs samebits.torch's C++ dispatcher ops in eager mode; one GPU (FSDP gathers
    weights that carry no main_grad).

    keep_logits_bytes: memory a training forward may spend keeping the LM head's fp32 logits for
    its backward (samebits.torch.lm_head_logprobs), which then runs three vocab GEMMs instead of
    four for the rows kept; the same bits. 0 (the default): none kept."""
    config = _config(hf_model)
    if main_grad and _common._ext is None:
        raise _core.Error("samebits.hf.patch: main_grad=True needs samebits.torch's C++ dispatcher ops, which this "
                          "build does not have for this torch")
    shape = _Shape(config)
    inner = getattr(hf_model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(hf_model, "lm_head"):
        raise _core.Error("samebits.hf.patch: expects a transformers *ForCausalLM (model.model.layers, lm_head)")
    for layer in inner.layers:
        layer._samebits_shape = shape
        layer._samebits_main_grad = main_grad
        layer.forward = types.MethodType(_layer_forward, layer)
    if main_grad:
        for p in hf_model.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if hf_model.lm_head.weight is inner.embed_tokens.weight:
            hf_model.lm_head.weight.main_grad_lm_head = torch.zeros_like(hf_model.lm_head.weight.main_grad)
    hf_model._samebits_shape = shape
    hf_model._samebits_main_grad = main_grad
    hf_model._samebits_keep_logits_bytes = int(keep_logits_bytes)
    hf_model.forward = types.MethodType(_model_forward, hf_model)
    hf_model.token_logprobs = types.MethodType(_token_logprobs, hf_model)
    return hf_model


def reduce_main_grad(hf_model):
    """After a step's last backward under patch(main_grad=True): a tied model's LM-head part of the
    shared weight's gradient (main_grad_lm_head) added into its main_grad, and zeroed; nothing for
    an untied model. The two sums are each split-independent, so their sum is too."""
    head = hf_model.lm_head.weight
    extra = getattr(head, "main_grad_lm_head", None)
    if extra is not None:
        head.main_grad.add_(extra)
        extra.zero_()

"""samebits on a Hugging Face transformers model (Qwen3 / Llama): the RL helper.

    import samebits.hf
    scorer = samebits.hf.Scorer(model)                     # the model's own weights, read in place
    logps = scorer.token_logprobs(sequences)               # per sequence a tensor [len - 1], differentiable
    loss = -sum((adv * lp).sum() for adv, lp in zip(advantages, logps))
    loss.backward()                                        # param.grad: the samebits chain's gradient

The sequences run through the samebits model chain (packed, no padding): a sequence's logprobs do
not depend on the others in the call, and the gradients do not depend on how the sequences are split
into calls. backward() adds the chain's own weight gradients (fp32 accumulators, bit for bit those of
`samebits.Chain.gradients` / `samebits grads` on the same weights and dlogp) into the parameters'
.grad, rounded once to the parameter's dtype; `scorer.last_grads` keeps the fp32 ones.

Where the weights are read: a model on the GPU with the cuda backend is read in place (no copy; an
optimizer's in-place update is seen by the next call). A CPU model on the CPU backend is read in
place too. Any other combination copies the weights once, when the Scorer is made: make a new one
after an optimizer step (a call on a stale copy, or after a parameter was replaced rather than
updated in place, raises samebits.Error). The chain runs on the device's default stream; a caller on another stream
is synchronized with it around each call.
"""
import contextlib
import json

import torch

from . import _core

_DTYPES = {"torch.bfloat16": ("bf16", "bfloat16"), "torch.float16": ("fp16", "float16"),
           "torch.float32": ("fp32", "float32")}


def _weights(hf_model):
    """{name: tensor} of the weights the chain reads (rotary buffers are recomputed, not read)."""
    return {n: t.detach() for n, t in hf_model.state_dict().items() if "rotary_emb" not in n}


def model_of(hf_model, device: str = "cpu") -> _core.Model:
    """A samebits Model over a transformers model's weights on `device` ("cpu" or "cuda"): the
    tensors themselves when they are there and contiguous, else a copy."""
    params = {}
    for n, t in _weights(hf_model).items():
        if device == "cuda" and t.is_cuda:
            if not t.is_contiguous():
                raise _core.Error(f"samebits.hf: weight '{n}' is not contiguous: the chain reads weights in place")
            params[n] = t
        else:
            params[n] = t.to("cpu").contiguous()
    dtypes = {str(t.dtype) for t in params.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
        raise _core.Error(f"samebits.hf: the model's weights must share one of bfloat16 / float16 / float32, "
                          f"found {sorted(dtypes)}")
    devices = {t.device for t in params.values()}
    if len(devices) != 1:
        raise _core.Error(f"samebits.hf: the model's weights are spread over {sorted(map(str, devices))}: "
                          "the chain runs on one device")
    ours, torch_name = _DTYPES[dtypes.pop()]
    config = json.loads(hf_model.config.to_json_string())
    config.pop("dtype", None)
    config["torch_dtype"] = torch_name
    kind = "cuda" if device == "cuda" and next(iter(devices)).type == "cuda" else "cpu"
    tensors = {n: (t.data_ptr(), ours, tuple(t.shape), kind, t) for n, t in params.items()}
    return _core.Model.from_tensors(json.dumps(config), tensors)


class _CudaArray:
    """One gradient accumulator of a Grads, for torch.as_tensor (keeps the Grads alive)."""

    def __init__(self, grads, name):
        self.grads = grads
        self.__cuda_array_interface__ = grads.cuda_array_interface(name)


class Scorer:
    """The samebits chain on a transformers model's weights, on `backend` ("auto": the GPU if any)."""

    def __init__(self, hf_model, backend: str = "auto"):
        if backend == "auto":
            backend = "cuda" if _core.cuda_available() else "cpu"
        weights = _weights(hf_model)
        first = next(iter(weights.values()))
        self.device = first.device if (backend == "cuda" and first.is_cuda) else \
            torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")
        with self._on_device():
            self.model = model_of(hf_model, backend)
            self.chain = _core.Chain(self.model, backend)
        # Whether the chain reads the module's own tensors (and so sees in-place updates).
        self.in_place = self.model.device == "cuda" or (backend == "cpu" and first.device.type == "cpu")
        self._module = hf_model
        self._params = [(n, p) for n, p in hf_model.named_parameters()]
        self._stamps = [(p.data_ptr(), p._version) for _, p in self._params]
        self.last_grads = None

    def _check_weights(self):
        """The chain reads what it was given: the module's own memory (in place) or a copy. A
        parameter replaced by another tensor (model.to(...), a new nn.Parameter) is no longer that
        memory, and a copy does not see in-place updates: either is refused, never read stale."""
        now = list(self._module.named_parameters())
        if [n for n, _ in now] != [n for n, _ in self._params]:
            raise _core.Error("samebits.hf: the model's parameters changed since the Scorer was made: make a new Scorer")
        for (name, p), (_, current), (ptr, version) in zip(self._params, now, self._stamps):
            if current is not p or p.data_ptr() != ptr:
                raise _core.Error(f"samebits.hf: parameter '{name}' was replaced since the Scorer was made "
                                  "(not updated in place): make a new Scorer")
            if not self.in_place and p._version != version:
                raise _core.Error(f"samebits.hf: parameter '{name}' changed since the Scorer copied the weights "
                                  "(this backend reads a copy): make a new Scorer")

    # ------------------------------------------------------------ stream and device hygiene
    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _call(self, fn, *args):
        """Runs a chain call on the default stream, ordered after and before the caller's stream."""
        self._check_weights()
        with self._on_device():
            side = self.device.type == "cuda" and torch.cuda.current_stream() != torch.cuda.default_stream()
            if side:
                torch.cuda.current_stream().synchronize()
            out = fn(*args)
            if side:
                torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
            return out

    # ------------------------------------------------------------ NumPy results (no autograd)
    def logprobs(self, sequences, entropy: bool = False):
        """Per sequence, log p(token i | tokens < i) as float64 NumPy arrays (entry 0 NaN); with
        entropy, a (logprobs, entropies) pair."""
        return self._call(self.chain.logprobs, _lists(sequences), entropy)

    def gradients(self, sequences, micro_batch: int = 16):
        """{parameter name: fp32 NumPy gradient of the summed logprobs}; a tied embedding's is the sum
        of its two uses (under model.embed_tokens.weight)."""
        return self._call(self.chain.gradients, _lists(sequences), micro_batch)

    # ------------------------------------------------------------ torch, with autograd
    def token_logprobs(self, sequences, entropy: bool = False):
        """Per sequence a float32 tensor [len - 1] on the model's device: log p(token i | tokens < i)
        for i = 1 … len - 1, differentiable with respect to the model's parameters (backward runs
        the chain's backward). With entropy, also the entropies (not differentiable)."""
        seqs = _lists(sequences)
        f = self._call(self.chain.forward, seqs)
        flat = _ChainLogprobs.apply(self, f, *[p for _, p in self._params])
        lengths = [len(s) - 1 for s in seqs]
        logps = list(flat.split(lengths))
        if not entropy:
            return logps
        ent = torch.from_numpy(f.entropy).to(self.device, torch.float32)
        return logps, list(ent.split(lengths))

    def _backward(self, forward, dlogp):
        """fp32 torch gradients {parameter name: tensor} of Σ dlogp · logp over one kept forward."""
        grads = self._call(self.chain.backward, forward, dlogp.detach().double().cpu().numpy())
        out = {}
        for name in grads.names():
            if self.device.type == "cuda":
                g = torch.as_tensor(_CudaArray(grads, name), device=self.device)
                if grads.tied and name == "model.embed_tokens.weight":  # the embedding's use + the LM head's
                    g = g + torch.as_tensor(_CudaArray(grads, "lm_head.weight"), device=self.device)
            else:
                g = torch.from_numpy(grads.host(name))
            out[name] = g
        return out


def _lists(sequences):
    return [list(map(int, s)) for s in sequences]


class _ChainLogprobs(torch.autograd.Function):
    """The chain's logprobs as a function of the module's parameters: backward is Chain::backward."""

    @staticmethod
    def forward(ctx, scorer, kept, *params):
        ctx.scorer, ctx.kept = scorer, kept  # the kept forward's activations live until backward
        ctx.versions = [p._version for _, p in scorer._params]
        return torch.from_numpy(kept.logp).to(scorer.device, torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dlogp):
        scorer = ctx.scorer
        for (name, p), version in zip(scorer._params, ctx.versions):
            if p._version != version:  # as torch refuses a saved tensor modified in place
                raise _core.Error(f"samebits.hf: parameter '{name}' was modified in place between the forward "
                                  "and its backward: the gradient would mix two sets of weights")
        grads = scorer._backward(ctx.kept, dlogp)
        scorer.last_grads = grads
        out = [None, None]
        for name, p in scorer._params:
            g = grads.get(name)
            out.append(None if g is None or not p.requires_grad else g.to(p.device, p.dtype))
        return tuple(out)


def logprobs(hf_model, sequences, entropy: bool = False, backend: str = "auto"):
    """One-off Scorer(hf_model, backend).logprobs(...)."""
    return Scorer(hf_model, backend).logprobs(sequences, entropy)


__all__ = ["Scorer", "logprobs", "model_of"]

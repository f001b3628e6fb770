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

Rollouts on the same weights, whose logprobs are the scorer's bit for bit (samebits.Engine):

    gen = samebits.hf.Generator(model, max_slots=64, kv_memory_bytes=8 << 30)
    out = gen.generate(prompts, n=8, temperature=1.0, max_new_tokens=512, seed=step)
    r = out[i][j]          # prompt i, sample j: r.tokens (int64), r.logprobs (float32), r.sequence

Where the weights are read: a model on the GPU with the cuda backend is read in place (no copy; an
optimizer's in-place update is seen by the next call). A CPU model on the CPU backend is read in
place too. Any other combination copies the weights once, when the Scorer / Generator is made: make
a new one after an optimizer step (a call on a stale copy, or after a parameter was replaced rather
than updated in place, raises samebits.Error). The chain runs on the device's default stream; a
caller on another stream is synchronized with it around each call.
"""
import contextlib
import dataclasses
import json

import numpy as np
import torch

from . import _core

_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def _weights(hf_model):
    """{name: tensor} of the weights the chain reads (rotary buffers are recomputed, not read)."""
    return {n: t.detach() for n, t in hf_model.state_dict().items() if "rotary_emb" not in n}


def _config_json(hf_model, dtype) -> str:
    """The transformers model's config as the chain's config.json, its dtype named as the weights'
    (`dtype`: a torch dtype); transformers 5's "dtype" key dropped for the "torch_dtype" the chain reads."""
    config = json.loads(hf_model.config.to_json_string())
    config.pop("dtype", None)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return json.dumps(config)


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
    dtype = next(iter(params.values())).dtype
    ours = _DTYPES[str(dtype)]
    kind = "cuda" if device == "cuda" and next(iter(devices)).type == "cuda" else "cpu"
    tensors = {n: (t.data_ptr(), ours, tuple(t.shape), kind, t) for n, t in params.items()}
    return _core.Model.from_tensors(_config_json(hf_model, dtype), tensors)


class _CudaArray:
    """One gradient accumulator of a Grads, for torch.as_tensor (keeps the Grads alive)."""

    def __init__(self, grads, name):
        self.grads = grads
        self.__cuda_array_interface__ = grads.cuda_array_interface(name)


class _OnModel:
    """What Scorer and Generator share: a samebits Model over a transformers model's weights for
    `backend` ("auto": the GPU if any), the device it runs on, and the check that the module still
    holds the tensors that Model reads (read in place) or was copied from."""

    def __init__(self, hf_model, backend: str):
        if backend == "auto":
            backend = "cuda" if _core.cuda_available() else "cpu"
        weights = _weights(hf_model)
        first = next(iter(weights.values()))
        self.backend = backend
        self.device = first.device if (backend == "cuda" and first.is_cuda) else \
            torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")
        with self._on_device():
            self.model = model_of(hf_model, backend)
        # Whether the chain reads the module's own tensors (and so sees in-place updates).
        self.in_place = self.model.device == "cuda" or (backend == "cpu" and first.device.type == "cpu")
        self._module = hf_model
        self._params = [(n, p) for n, p in hf_model.named_parameters()]
        self._stamps = [(p.data_ptr(), p._version) for _, p in self._params]

    def _check_weights(self):
        """The chain reads what it was given: the module's own memory (in place) or a copy. A
        parameter replaced by another tensor (model.to(...), a new nn.Parameter) is no longer that
        memory, and a copy does not see in-place updates: either is refused, never read stale."""
        kind = type(self).__name__
        now = list(self._module.named_parameters())
        if [n for n, _ in now] != [n for n, _ in self._params]:
            raise _core.Error(f"samebits.hf: the model's parameters changed since the {kind} was made: "
                              f"make a new {kind}")
        for (name, p), (_, current), (ptr, version) in zip(self._params, now, self._stamps):
            if current is not p or p.data_ptr() != ptr:
                raise _core.Error(f"samebits.hf: parameter '{name}' was replaced since the {kind} was made "
                                  f"(not updated in place): make a new {kind}")
            if not self.in_place and p._version != version:
                raise _core.Error(f"samebits.hf: parameter '{name}' changed since the {kind} copied the weights "
                                  f"(this backend reads a copy): make a new {kind}")

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


class Scorer(_OnModel):
    """The samebits chain on a transformers model's weights, on `backend` ("auto": the GPU if any)."""

    def __init__(self, hf_model, backend: str = "auto"):
        super().__init__(hf_model, backend)
        with self._on_device():
            self.chain = _core.Chain(self.model, self.backend)
        self.last_grads = None

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
        the chain's backward). Under torch.no_grad (or with no parameter requiring a gradient) the
        chain keeps no activations: the same bits in about two layers' memory. With entropy, also
        the entropies (not differentiable)."""
        seqs = _lists(sequences)
        wants_grad = torch.is_grad_enabled() and any(p.requires_grad for _, p in self._params)
        # Without a gradient to come, no activations are kept (Chain::score: the same bits).
        f = self._call(self.chain.forward, seqs, wants_grad)
        if wants_grad:
            flat = _ChainLogprobs.apply(self, f, *[p for _, p in self._params])
        else:
            flat = torch.from_numpy(f.logp).to(self.device, torch.float32)
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
    """Lists of ints from lists, 1-D tensors or a 2-D tensor (a tensor copied to the host once)."""
    if isinstance(sequences, torch.Tensor):
        sequences = sequences.tolist()
    return [s.tolist() if isinstance(s, torch.Tensor) else list(map(int, s)) for s in sequences]


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


@dataclasses.dataclass
class Rollout:
    """One sample of one prompt, as Generator.generate returns it. The tensors are on the model's
    device (the Generator's `device`); `logprobs` are the trainer's: bit for bit the entries of
    Scorer(model).token_logprobs([prompt + tokens])[0] that score the generated tokens."""
    prompt: torch.Tensor  # int64 [P]: the prompt's tokens (padding removed); shared by the prompt's samples
    tokens: torch.Tensor  # int64 [T]: the generated tokens (a stop token included)
    logprobs: torch.Tensor  # float32 [T]: log p(tokens[t] | prompt, tokens[:t]), before temperature / truncation
    finish_reason: str  # "stop", "length", or "error" (then tokens and logprobs are empty)
    sample: int = 0  # which of the prompt's n samples
    error: str = ""  # with "error": the message naming the request and the problem
    # float64 [T]: log p(tokens[t]) under the distribution it was drawn from (temperature and
    # top-k / top-p / min-p applied; 0 for greedy): the behaviour policy's, for importance weights
    sampling_logprobs: torch.Tensor = None

    @property
    def sequence(self):
        """prompt + tokens, int64 [P + T]: what the trainer scores."""
        return torch.cat([self.prompt, self.tokens])


class Generator(_OnModel):
    """Rollouts from a transformers model through samebits.Engine, on the model's own weights.

    Like Scorer, it builds the samebits Model over the module's tensors: on the GPU they are read in
    place, so an optimizer's in-place update is what the next generate() samples from, with no new
    Generator; a replaced parameter (or, on a backend that copied the weights, a changed one) is
    refused with samebits.Error. `engine_options` are samebits.Engine's (max_slots,
    max_batch_tokens, max_context, share_prefix, page_size, kv_pages, kv_memory_bytes, cuda_graphs,
    overlap_steps); the engine and its KV cache live as long as the Generator."""

    def __init__(self, hf_model, backend: str = "auto", **engine_options):
        super().__init__(hf_model, backend)
        with self._on_device():
            self.engine = _core.Engine(self.model, self.backend, **engine_options)

    def generate(self, prompts, params=None, *, attention_mask=None, **sampling):
        """Per prompt, its n Rollouts (in sample order).

        prompts: lists of token ids, 1-D tensors, or a 2-D tensor [B, S]; attention_mask (a tensor
        or lists of the same shape, 1 = token, 0 = padding, left or right) drops the padding.
        params: one samebits.SamplingParams for all prompts or one per prompt; or, without params,
        SamplingParams' keywords (n=8, temperature=1.0, top_p=..., max_new_tokens=..., seed=...).
        A bad prompt gives one Rollout with finish_reason "error" and the message; the others run."""
        if params is None:
            params = _core.SamplingParams(**sampling)
        elif sampling:
            raise _core.Error(f"samebits.hf.Generator.generate: give params or SamplingParams keywords "
                              f"({', '.join(sampling)}), not both")
        lists = _prompts(prompts, attention_mask)
        out = self._call(self.engine.generate, lists, params)
        return self._rollouts(lists, out)

    def _rollouts(self, lists, out):
        """The engine's completions as Rollouts: one host-to-device copy for every prompt, token and
        logprob, then views of it."""
        if not lists:
            return []
        flat = [c for cs in out for c in cs]
        prompt_ids = torch.tensor([t for p in lists for t in p], dtype=torch.long).to(self.device)
        token_ids = torch.tensor([t for c in flat for t in c.tokens], dtype=torch.long).to(self.device)
        logps = np.concatenate([c.logprobs for c in flat]) if flat else np.zeros(0)
        logps = torch.from_numpy(logps).to(self.device, torch.float32)  # as Scorer.token_logprobs rounds them
        slogps = np.concatenate([c.sampling_logprobs for c in flat]) if flat else np.zeros(0)
        slogps = torch.from_numpy(slogps).to(self.device, torch.float64)
        prompts = prompt_ids.split([len(p) for p in lists])
        lengths = [len(c.tokens) for c in flat]
        tokens, lp, slp = token_ids.split(lengths), logps.split(lengths), slogps.split(lengths)
        result, k = [], 0
        for i, cs in enumerate(out):
            row = []
            for c in cs:
                row.append(Rollout(prompts[i], tokens[k], lp[k], c.finish_reason, c.sample, c.error, slp[k]))
                k += 1
            result.append(row)
        return result


def _prompts(prompts, attention_mask):
    """Lists of token ids from lists / 1-D tensors / a 2-D tensor, without the masked-out padding."""
    if isinstance(prompts, torch.Tensor) and prompts.dim() != 2:
        raise _core.Error(f"samebits.hf.Generator.generate: argument 'prompts': a tensor of prompts is 2-D [batch, "
                          f"length], got {prompts.dim()}-D (a list of 1-D tensors is taken too)")
    rows = _lists(prompts)
    if attention_mask is None:
        return rows
    mask = _lists(attention_mask)
    if len(mask) != len(rows) or any(len(m) != len(r) for m, r in zip(mask, rows)):
        raise _core.Error("samebits.hf.Generator.generate: argument 'attention_mask': its shape is not the prompts'")
    out = []
    for i, (r, m) in enumerate(zip(rows, mask)):
        kept = [k for k, v in enumerate(m) if v]
        if kept and kept[-1] - kept[0] + 1 != len(kept):
            raise _core.Error(f"samebits.hf.Generator.generate: argument 'attention_mask': row {i} has padding "
                              "between its tokens (only left or right padding is taken)")
        out.append([r[k] for k in kept])
    return out


def logprobs(hf_model, sequences, entropy: bool = False, backend: str = "auto"):
    """One-off Scorer(hf_model, backend).logprobs(...)."""
    return Scorer(hf_model, backend).logprobs(sequences, entropy)


from ._patch import patch, reduce_main_grad  # noqa: E402 (the module mode: samebits' ops in the model's modules)

__all__ = ["Generator", "Rollout", "Scorer", "logprobs", "model_of", "patch", "reduce_main_grad"]

"""samebits on a Hugging Face transformers model (Qwen3 / Llama): the RL helper.

    import samebits.hf
    scorer = samebits.hf.Scorer(model)                   # a snapshot of the model's weights
    logp, entropy = scorer.logprobs([[1, 2, 3], [4, 5]], entropy=True)   # per sequence, entry 0 NaN
    grads = scorer.gradients(sequences, micro_batch=8)   # {parameter name: fp32 gradient of Σ logp}

The sequences run through the samebits model chain (packed, no padding): a sequence's logprobs do
not depend on the others in the call, and the gradients do not depend on the micro-batch split.
The weights are copied once to CPU memory (and, on the GPU backend, once to the device) when the
Scorer is made: make a new one after an optimizer step.
"""
import json

from . import _core

_DTYPES = {"torch.bfloat16": ("bf16", "bfloat16"), "torch.float16": ("fp16", "float16"),
           "torch.float32": ("fp32", "float32")}


def model_of(hf_model) -> _core.Model:
    """A samebits Model over a snapshot of a transformers model's weights (CPU, contiguous)."""
    params = {n: p.detach().to("cpu").contiguous() for n, p in hf_model.state_dict().items()
              if "rotary_emb" not in n}
    dtypes = {str(t.dtype) for t in params.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
        raise _core.Error(f"samebits.hf: the model's weights must share one of bfloat16 / float16 / float32, "
                          f"found {sorted(dtypes)}")
    ours, torch_name = _DTYPES[dtypes.pop()]
    config = json.loads(hf_model.config.to_json_string())
    config.pop("dtype", None)
    config["torch_dtype"] = torch_name
    tensors = {n: (t.data_ptr(), ours, tuple(t.shape), "cpu", t) for n, t in params.items()}
    return _core.Model.from_tensors(json.dumps(config), tensors)


class Scorer:
    """The samebits chain on a transformers model's weights, on `backend` ("auto": the GPU if any)."""

    def __init__(self, hf_model, backend: str = "auto"):
        self.model = model_of(hf_model)
        self.chain = _core.Chain(self.model, backend)

    def logprobs(self, sequences, entropy: bool = False):
        """Per sequence, log p(token i | tokens < i) as float64 NumPy arrays (entry 0 NaN); with
        entropy, a (logprobs, entropies) pair."""
        return self.chain.logprobs([list(map(int, s)) for s in sequences], entropy)

    def gradients(self, sequences, micro_batch: int = 16):
        """{parameter name: fp32 gradient of the summed logprobs}; a tied embedding's is the sum of
        its two uses (under model.embed_tokens.weight)."""
        return self.chain.gradients([list(map(int, s)) for s in sequences], micro_batch)


def logprobs(hf_model, sequences, entropy: bool = False, backend: str = "auto"):
    """One-off Scorer(hf_model, backend).logprobs(...)."""
    return Scorer(hf_model, backend).logprobs(sequences, entropy)


__all__ = ["Scorer", "logprobs", "model_of"]

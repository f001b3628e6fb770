#!/usr/bin/env python3
"""Where do samebits' bf16 activations and transformers' bf16 activations part from exact
arithmetic? Activation by activation, on the models of tools/hf_parity.py.

    python3 tools/hf_drift.py SAMEBITS_BINARY [--model qwen3-tied] [--device cuda] [--md OUT.md]

For one random-initialised model (the parity script's, same seed) rounded to bf16: transformers in
bf16, samebits in bf16 (`samebits activations`, on --device) and the reference — transformers in
fp32 on the same bf16 weights (TF32 off). Each activation of the chain that transformers exposes to
hooks is compared with the reference: relative L2 error ‖a − ref‖ / ‖ref‖ over every row of the
parity sequences, for samebits and for transformers. An activation where samebits' error jumps
above transformers' is a rounding samebits adds; the last rows are the logprobs themselves.
Needs torch and transformers.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_parity  # noqa: E402  (the models and sequences of the parity run)


def hf_activations(model, seqs, device):
    """The chain's activations, named as samebits names them, rows of all sequences in order."""
    model = model.to(device).eval()
    got, hooks = {}, []

    def keep(name, use_input=False):
        def hook(_module, args, out):
            t = args[0] if use_input else (out[0] if isinstance(out, tuple) else out)
            got.setdefault(name, []).append(t.detach()[0].float().cpu())
        return hook

    m = model.model
    hooks.append(m.embed_tokens.register_forward_hook(keep("embed")))
    n = len(m.layers)
    for l, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        for mod, name, use_input in ((layer.input_layernorm, "n1", False), (a.q_proj, "q", False),
                                     (a.k_proj, "k", False), (a.v_proj, "v", False), (a.o_proj, "attn", True),
                                     (a.o_proj, "o", False), (layer.post_attention_layernorm, "x_mid", True),
                                     (layer.post_attention_layernorm, "n2", False), (mlp.gate_proj, "gate", False),
                                     (mlp.up_proj, "up", False), (mlp.down_proj, "swiglu", True),
                                     (mlp.down_proj, "down", False)):
            hooks.append(mod.register_forward_hook(keep(f"layer{l}.{name}", use_input)))
        hooks.append(layer.register_forward_hook(keep("final.x_in" if l + 1 == n else f"layer{l + 1}.x_in")))
    hooks.append(m.norm.register_forward_hook(keep("final.n1")))
    # q / k after QK-norm and RoPE: the rotary function's outputs, recorded by a wrapper.
    import importlib
    mod = importlib.import_module(type(model).__module__)
    rotary = mod.apply_rotary_pos_emb
    layer_of_call = []

    def recording_rotary(q, k, *rest, **kw):
        qr, kr = rotary(q, k, *rest, **kw)
        l = len(layer_of_call) % n
        layer_of_call.append(l)
        for name, t in ((f"layer{l}.q_rope", qr), (f"layer{l}.k_rope", kr)):  # [1, heads, S, D] → [S, heads·D]
            got.setdefault(name, []).append(t.detach()[0].transpose(0, 1).reshape(t.shape[2], -1).float().cpu())
        return qr, kr
    mod.apply_rotary_pos_emb = recording_rotary
    logp = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s], device=device)
            logits = model(input_ids=ids).logits.float()[0]
            lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            logp.append(torch.cat([lp, torch.zeros(1, device=device)]).cpu())  # the last row is not scored
    mod.apply_rotary_pos_emb = rotary
    for h in hooks:
        h.remove()
    out = {k: torch.cat(v) for k, v in got.items()}
    out["head.logp"] = torch.cat(logp)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("samebits")
    ap.add_argument("--model", default="qwen3-tied", help="qwen3-untied | qwen3-tied | llama3")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--md")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = dict(hf_parity.model_configs())[args.model]
    seqs = hf_parity.sequences(config.vocab_size, args.seed + 1)
    work = tempfile.mkdtemp(prefix="samebits_drift_")
    model16 = hf_parity.build(args.model, config, args.seed).to(torch.bfloat16)
    for key in ("torch_dtype", "dtype"):
        setattr(model16.config, key, torch.bfloat16)
    model16.save_pretrained(os.path.join(work, "bf16"), safe_serialization=True)
    with open(os.path.join(work, "seqs.jsonl"), "w") as f:
        for s in seqs:
            f.write(json.dumps({"tokens": s}) + "\n")
    backend = "cuda" if args.device == "cuda" else "cpu"
    def samebits_activations(backend):
        out = os.path.join(work, f"sb-{backend}.safetensors")
        subprocess.run([args.samebits, "activations", "--model", os.path.join(work, "bf16"), "--input",
                        os.path.join(work, "seqs.jsonl"), "--output", out, "--backend", backend], check=True,
                       capture_output=True)
        return {k: v.float() for k, v in load_file(out).items()}
    ours = samebits_activations(backend)
    ours_cpu = samebits_activations("cpu") if backend != "cpu" else ours
    hf16 = hf_activations(hf_parity.load(os.path.join(work, "bf16"), torch.bfloat16), seqs, args.device)
    ref = hf_activations(hf_parity.load(os.path.join(work, "bf16"), torch.float32), seqs, args.device)
    rows = [f"# Activation drift from exact arithmetic: samebits and transformers in bf16 ({args.model})", "",
            "Generated by `python3 tools/hf_drift.py SAMEBITS --model " + args.model + "`; reference: transformers "
            "fp32 on the same bf16 weights. Relative L2 error over every row (max |error| in parentheses).", "",
            "The worst row is the row (token, sequences packed in order) of the largest relative row error.", "",
            f"| activation | samebits bf16 ({backend}) | transformers bf16 | samebits / transformers | samebits bf16 (cpu) | "
            "worst row: samebits / transformers |", "| --- | --- | --- | --- | --- | --- |"]

    def worst_row(a, r):
        a, r = a.reshape(r.shape[0], -1), r.reshape(r.shape[0], -1)
        rel = (a - r).norm(dim=1) / r.norm(dim=1).clamp_min(1e-30)
        i = int(rel.argmax())
        return f"{i} ({rel[i].item():.3g}, row norm {r[i].norm().item():.3g})"
    for name, r in ref.items():
        if name not in ours:
            continue
        a = ours[name].reshape(r.shape)
        b = hf16[name].reshape(r.shape)
        ea, eb = ((a - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
        ma, mb = (a - r).abs().max().item(), (b - r).abs().max().item()
        c = ours_cpu[name].reshape(r.shape)
        ec = ((c - r).norm() / r.norm()).item()
        rows.append(f"| {name} | {ea:.3g} ({ma:.3g}) | {eb:.3g} ({mb:.3g}) | {ea / eb if eb else float('inf'):.2f} | "
                    f"{ec:.3g} | {worst_row(a, r)} / {worst_row(b, r)} |")
    text = "\n".join(rows) + "\n"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())

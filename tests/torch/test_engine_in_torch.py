"""The generation engine in a process where PyTorch is loaded: samebits' device memory then comes
from torch's caching allocator (samebits.torch installs it), and its own pool is made only when
something needs it. The first decode step's CUDA graph capture once was that something: creating a
pool is refused while a stream captures, the capture failed, and every decode step of the engine
ran eagerly (1.7x the time of a Qwen3-8B step) without an error. Each case runs in a fresh process,
since any earlier samebits call in this one may already have made the pool, and gives the engine
its KV pages (sizing them from the free memory queries the pool, which makes it)."""
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

FRESH = textwrap.dedent("""
    import torch
    import samebits
    import samebits.torch  # installs torch's caching allocator for samebits' device memory
    from samebits.torch import _common
    if _common._ext is None:
        print("no dispatcher library: torch's allocator not installed")
        raise SystemExit(0)
    x = torch.ones(8, device="cuda")  # torch's CUDA state first, as in a training script
    model = samebits.Model.builtin()
    # kv_pages given: the engine asks nothing of the device's free memory (a query that makes
    # samebits' pool on the way, which hid the failure wherever the pool was sized from it)
    engine = samebits.Engine(model, "cuda", page_size=16, kv_pages=64)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    out = engine.generate(prompts, samebits.SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5))
    print("graphs", engine.captured_graphs, engine.graph_steps, repr(engine.graphs_off_reason))
    eager = samebits.Engine(model, "cuda", page_size=16, cuda_graphs=False)
    same = eager.generate(prompts, samebits.SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5))
    for a, b in zip(sum(out, []), sum(same, [])):
        assert a.tokens == b.tokens and a.logprobs.tobytes() == b.logprobs.tobytes()
    print("same bits")
""")


def test_decode_steps_replay_graphs_when_torch_serves_the_memory():
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        pytest.skip("the engine captures decode graphs on Hopper only")
    env = dict(os.environ)
    env.pop("SAMEBITS_TORCH_ALLOCATOR", None)
    # samebits.Engine's warning that its graphs went off (a failed capture) as an error
    run = subprocess.run([sys.executable, "-W", "error:samebits.Engine:RuntimeWarning", "-c", FRESH], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    if "no dispatcher library" in run.stdout:
        pytest.skip("built without torch's C++ dispatcher ops: torch's allocator is not installed")
    line = next(l for l in run.stdout.splitlines() if l.startswith("graphs"))
    _, captured, steps, reason = line.split(" ", 3)
    assert reason == "''", f"the decode graphs went off: {reason}"
    assert int(captured) > 0 and int(steps) > 0, line
    assert "same bits" in run.stdout

#!/usr/bin/env bash
# The serving engine's checks on a GPU, as one short run for a session that is lent one (about 5
# minutes on an H200; run from the repository root with the machine's own python3 and torch):
# the CUDA-graph tests (captured graphs against transformers, enforce_eager=True and four decode
# steps per engine step), then benchmarks/cuda_decode.py (graphs against eager decode steps, fp32
# and bf16, batch 1 to 64), then the engine's profiler with CUDA activity, its trace read back by
# `slipstream perf trace` (kernels per step, the GPU split).
# Logs go to $OUT when it is set (the device tool's output folder), else to the current folder.
set -euo pipefail
out="${OUT:-$PWD}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The GPU test imports transformers for its reference and skips (passing) without it: fail here.
python3 -c "import torch, transformers, pytest; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py tests/test_moe_serving.py -k "cuda or CUDA" 2>&1 | tee "$out/gpu_tests.log"
cd benchmarks
python3 cuda_decode.py --dtype both --batch-sizes 1,8,32,64 --repeats 3 2>&1 | tee "$out/cuda_decode.log"
cd ..
python3 -m slipstream.cli init-model "$out/tiny" --preset tiny --overwrite
python3 - "$out" <<'PY' 2>&1 | tee "$out/gpu_profile.log"
import json, subprocess, sys
from slipstream import LLM, SamplingParams
out = sys.argv[1]
llm = LLM(f"{out}/tiny", profiler_config={"profiler": "torch", "torch_profiler_dir": f"{out}/traces"})
llm.start_profile()
llm.generate(["def f(x):"] * 8, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
llm.stop_profile()
text = subprocess.run([sys.executable, "-m", "slipstream.cli", "perf", "trace", f"{out}/traces", "--top", "5"],
                      capture_output=True, text=True, check=True).stdout
print(text)
report = json.loads(subprocess.run([sys.executable, "-m", "slipstream.cli", "perf", "trace", f"{out}/traces",
                                    "--json"], capture_output=True, text=True, check=True).stdout)
rank = report["ranks"][0]
assert rank["gpu"] and rank["kernels"] and all(s["gpu"] for s in rank["steps"]), "no GPU kernels per step"
print("profiler on CUDA: ok,", len(rank["steps"]), "steps,", round(rank["gpu"]["compute_us"]), "us of compute")
PY

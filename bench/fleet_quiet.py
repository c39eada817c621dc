"""False drift behind a balanced fleet: two scripted members (their own fingerprints, logprob offsets and
server-side snapshot fields: a bfloat16 server has twice the kv-cache blocks of a float32 one) behind one
URL, picked at random or in turn, exact or under the realistic ``gpu-bf16`` noise model, probed for
``--passes`` unchanged passes per seed. Prints the drift verdicts of any kind per case.

``--schedule`` draws which member answers each pass's snapshot in this script instead of the kind (a
change of the snapshot fields on a random half of the passes): the same input for a canaryd whose
scripted kind has no per-member snapshot, to measure before and after a change.

    python bench/fleet_quiet.py --seeds 20 --passes 10
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections import Counter
from pathlib import Path

from canaryd.judge.compare import Verdict
from tests.harness.scripted_lab import ScriptedLab, _toml, change, scripted

FP32 = {"metrics.vllm:cache_config_info.num_gpu_blocks": "1000", "metrics.vllm:cache_config_info.kv": "8000"}
BF16 = {"metrics.vllm:cache_config_info.num_gpu_blocks": "2000", "metrics.vllm:cache_config_info.kv": "16000"}
SUITE = '[suite]\nname = "fleet"\n' + "".join(
    f'[[canary]]\nid = "c{i}"\nprompt = "question {i}"\nexpect = {{ exact = "answer {i}" }}\n'
    for i in range(6)
)


def backend(pick: str, noise: str, seed: int, passes: int, schedule: bool) -> str:
    body = ""
    for name, fp, shift, snap in (("fp32", "vllm-a", 0.0, FP32), ("bf16", "vllm-b", -0.03, BF16)):
        body += f'[[backends.fleet]]\nname = "{name}"\nfingerprint = "{fp}"\nlogprob_shift = {shift}\n'
        if not schedule:
            body += f"snapshot = {_toml(snap)}\n"
    settings: dict = {"concurrency": 4, "seed": seed, "fleet_pick": pick}
    if schedule:  # the snapshot's member drawn here: bf16's fields on a random half of the passes
        rng = random.Random(f"schedule:{seed}")
        body += "".join(
            change(at=c, until=c + 1, stack=BF16) for c in range(1, passes + 1) if rng.random() < 0.5
        )
        settings["stack"] = FP32
    if noise != "exact":
        settings["noise_model"] = {"preset": noise}
    return scripted(body=body, **settings)


def run(pick: str, noise: str, seed: int, passes: int, schedule: bool) -> Counter:
    with tempfile.TemporaryDirectory() as d:
        lab = ScriptedLab(Path(d), backend(pick, noise, seed, passes, schedule), {"fleet.toml": SUITE})
        try:
            out: Counter = Counter()
            for _ in range(passes):
                for r in lab.cycle().results:
                    out[r.comparison.verdict.value] += 1
            return out
        finally:
            lab.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--schedule", action="store_true")
    args = ap.parse_args()
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    for pick in ("random", "round-robin"):
        for noise in ("exact", "gpu-bf16"):
            total: Counter = Counter()
            for seed in range(args.seeds):
                total += run(pick, noise, seed, args.passes, args.schedule)
            drift = {v: n for v, n in total.items() if Verdict(v).is_drift}
            print(
                f"{pick:12} {noise:9} seeds {args.seeds} passes {args.passes}: "
                f"{sum(drift.values())} drift of {sum(total.values())} verdicts {drift or ''}"
            )


if __name__ == "__main__":
    main()

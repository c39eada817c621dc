"""`canaryd demo`: the whole loop on one CPU, no GPU and no API key.

1. build a tiny Llama-style model, trained for a few seconds to answer the default suite's canaries;
2. serve it with a real vLLM (float32) and probe: the first observations become the baselines;
3. probe again: everything is ``identical``;
4. restart the *same weights* with ``--dtype bfloat16`` — same model name, same answers, a silent shift;
5. probe again: canaryd reports drift and names the stack fields that moved, the cause first: the host
   probe reads the server's own command line, so ``engine.dtype: float32 -> bfloat16`` leads the advice,
   before the cache sizes it implies.

The demo exits 0 when canaryd behaved as described, 1 otherwise.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from canaryd.canaries import load_suite
from canaryd.config import load_config
from canaryd.judge.compare import Verdict
from canaryd.probe.run import Result, one_pass
from canaryd.progress import shown
from canaryd.report.record import revert_rank, suggest
from canaryd.report.tables import print_tables, results_table, stack_changes_table
from canaryd.scaffold import shipped_canaries

CONFIG = """\
# Written by `canaryd demo`: the embedded default (SQLite + a local vLLM CPU server).
state_dir = "{state}"
suites = ["{suite}"]

{backend}"""


def _verdicts(results: list[Result]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.comparison.verdict.value] = counts.get(r.comparison.verdict.value, 0) + 1
    return counts


def run_demo(workdir: Path, console: Console, progress: bool = True) -> int:
    """The demo; ``progress`` shows training and probing on stderr when it is a terminal."""
    from canaryd.lab.tinymodel import build_tiny_model
    from canaryd.lab.vllm_process import VLLMServer, backend_block, free_port

    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    suite_path = shipped_canaries() / "default.toml"
    suite = load_suite(suite_path)
    known = [c for c in suite.canaries if c.expect is not None and c.expect.answer is not None]
    train = [
        (c.prompt if c.prompt is not None else [m.model_dump() for m in c.messages], c.expect.answer)
        for c in known
    ]
    # Answers that must fit in fewer tokens than they have bytes become whole-word tokens.
    words = sorted({c.expect.answer for c in known if len(c.expect.answer.encode()) >= c.decoding.max_tokens})
    console.rule("1. a tiny model, built on the spot")
    with shown("training", "steps", enabled=progress):
        model = build_tiny_model(workdir / "model", seed=0, train=train, steps=600, words=words)
    console.print(f"model: {model} (trained on {len(train)} canary answers)")

    port = free_port()
    cfg_path = workdir / "canaryd.toml"
    cfg_path.write_text(
        CONFIG.format(
            state=workdir / "state",
            suite=suite_path,
            backend=backend_block("local-vllm", port, host_probe=True),
        )
    )
    (workdir / "state" / "canaryd.db").unlink(missing_ok=True)  # every demo starts from an empty history
    config = load_config(cfg_path)

    def serve(dtype: str) -> VLLMServer:
        console.print(f"starting vLLM (CPU) with --dtype {dtype} on port {port} (about 40 s) ...")
        # torch.compile's warm-up (about 30 s a start here) buys a model this small nothing
        log = workdir / f"vllm-{dtype}.log"
        return VLLMServer(model, port=port, dtype=dtype, extra_args=["--enforce-eager"], log_path=log)

    def probed() -> list[Result]:
        with shown("probing", "canaries", enabled=progress):
            return [r for run in one_pass(config) for r in run.results]

    def show(title: str, results: list[Result]) -> dict[str, int]:
        console.rule(title)
        print_tables(console, results_table(results), stack_changes_table(results))
        counts = _verdicts(results)
        console.print(f"verdicts: {counts}")
        return counts

    with serve("float32"):
        first = show("2. first probe: observations become baselines", probed())
        again = show("3. probe again, nothing changed", probed())
    with serve("bfloat16"):
        shifted_results = probed()
        shifted = show("4-5. same weights restarted with --dtype bfloat16: a silent shift", shifted_results)

    changes = sorted(
        {c for r in shifted_results for c in r.comparison.stack_changes},
        key=lambda c: (revert_rank(c.field), c.field),
    )
    console.print(f"what to revert first: {suggest(changes)}")
    drift = sum(n for v, n in shifted.items() if Verdict(v).is_drift)
    ok = (
        first == {"baseline": len(suite.canaries)}
        and again == {"identical": len(suite.canaries)}
        and drift > 0
        and [(c.field, c.before, c.after) for c in changes[:1]] == [("engine.dtype", "float32", "bfloat16")]
    )
    console.rule("result")
    console.print(
        f"{'OK' if ok else 'UNEXPECTED'}: baseline {first.get('baseline', 0)}, identical on re-probe "
        f"{again.get('identical', 0)}, drift after the silent shift {drift} of {len(suite.canaries)}.\n"
        f"Explore: canaryd -c {cfg_path} explain local-vllm | history | stack | baseline accept | check"
    )
    return 0 if ok else 1

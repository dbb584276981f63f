"""Literal `specdec bench` JSON for the report tests: one run's record and a whole bench document."""

from __future__ import annotations

from specdec_cli.measure import bench as B


def run(config, prompt, tps, *, kind="edit", repeat=0, cold=False, tokens=(1, 2, 3, 4), drafted=0, accepted=0,
        spec_steps=0, ttft=None, rss=1000):
    """One run of `config` on `prompt` at `tps` decode tok/s, as bench's JSON records it."""
    return {"config": config, "prompt": prompt, "kind": kind, "repeat": repeat, "cold": cold, "tokens_per_s": tps,
            "tokens": list(tokens), "n_drafted": drafted, "n_accepted": accepted, "n_spec_steps": spec_steps,
            "ttft_ms": ttft, "peak_rss_kib": rss}


def bench_doc(runs, configs, prompts):
    """A bench JSON document holding `runs` of `configs` (BenchConfig) on `prompts` ((name, kind) pairs)."""
    return {"version": B.JSON_VERSION, "target": "/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "draft": None,
            "prompts": [{"name": n, "kind": k, "n_tokens": 612} for n, k in prompts],
            "settings": {"repeats": 2, "max_tokens": 128, "k": "auto", "ctx": 4096, "threads": 2},
            "started_at": "now", "configs": [c.label for c in configs], "runs": runs,
            "machine": {"cpu": "AMD EPYC 7B13 64-Core Processor", "cores": 1, "logical_cpus": 2, "threads": 2,
                        "memory_bytes": 25 * 2**30, "llama_cpp_python": "0.3.36"}}

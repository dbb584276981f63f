"""`specdec bench`'s measuring processes: one per family ("ours": our engine; "peer": llama-cpp-python's lookup).

The parent drives each with JSON lines over stdin/stdout (`BenchProcess.call`); the child (`worker_main`) serves
one family's requests until its input ends. Workers ignore SIGINT and run in their own session, so Ctrl-C reaches
only the parent, which stops them. Peak RSS is read per run from /proc, or what the platform offers where there is
none (Windows: the peak working set; see `specdec_cli.measure.bench`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from specdec_cli.errors import BackendError, SpecdecError
from specdec_cli.spec import Method

WARMUP_PROMPT = "Say hello."


# --------------------------------------------------------------------------------------------------------------
# The parent side


class BenchProcess:
    """A measuring process for one family ("ours" or "peer"), driven by JSON lines. `info` is its reply to init.
    (Not the server's `Worker`, which is a thread serving requests.)"""

    def __init__(self, family: str, init: dict[str, Any]) -> None:
        self.family = family
        code = "from specdec_cli.measure.bench_process import worker_main; worker_main()"
        # Own session: Ctrl-C in the terminal reaches only the parent, which stops the workers itself.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            bufsize=1,
            start_new_session=True,
        )
        try:
            self.info = self.call({"op": "init", "family": family, **init})
        except BaseException:
            self.close(kill=True)
            raise

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its reply. Raises the worker's SpecdecError, or BackendError if it died."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None  # (pipes)
        try:
            stdin.write(json.dumps(msg) + "\n")
            stdin.flush()
            line = stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = self.proc.wait()
            raise BackendError(
                f"The bench worker for {self.family} exited with code {code}.",
                "Run with --verbose to see llama.cpp's log, or SPECDEC_DEBUG=1 for tracebacks.",
            )
        reply = json.loads(line)
        if "error" in reply:
            raise _remote_error(reply["error"])
        return reply

    def close(self, *, kill: bool = False) -> None:
        """Stop the worker: end of input (it closes its models), or SIGKILL when `kill` or when it does not exit."""
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                try:
                    if self.proc.stdin is not None:
                        self.proc.stdin.close()
                    self.proc.wait(timeout=60)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


def _remote_error(e: dict[str, Any]) -> SpecdecError:
    """The worker's error as the same SpecdecError subclass (message and fix), or a BackendError for a bug."""
    from specdec_cli import errors

    cls = getattr(errors, e.get("type", ""), None)
    if isinstance(cls, type) and issubclass(cls, SpecdecError):
        err = cls.__new__(cls)
        SpecdecError.__init__(err, e["message"], e.get("fix"))
        return err
    return BackendError(
        f"A bench worker failed: {e.get('type')}: {e.get('message')} (a bug in specdec).",
        "Run with SPECDEC_DEBUG=1 for the worker's traceback.",
    )


# --------------------------------------------------------------------------------------------------------------
# The child side


def worker_main() -> None:
    """Serve one family's requests: JSON lines on stdin, replies on the original stdout (fd 1 is pointed at stderr
    so nothing llama.cpp prints can corrupt the replies). Ends at end of input."""
    import traceback
    import warnings

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    warnings.showwarning = lambda m, *a, **k: print(f"warning: {m}", file=sys.stderr)
    debug = os.environ.get("SPECDEC_DEBUG", "") not in ("", "0")
    runner = None
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            try:
                if msg["op"] == "init":
                    runner = _OursRunner(msg) if msg["family"] == "ours" else _PeerRunner(msg)
                    reply = runner.info
                else:
                    assert runner is not None, "the first message is init"
                    reply = runner.run(msg)
            except SpecdecError as e:
                if debug:
                    traceback.print_exc()
                reply = {"error": {"type": type(e).__name__, "message": e.message, "fix": e.fix}}
            except Exception as e:  # a bug: the parent says so
                if debug:
                    traceback.print_exc()
                reply = {"error": {"type": type(e).__name__, "message": str(e)}}
            replies.write(json.dumps(reply) + "\n")
    finally:
        if runner is not None:
            runner.close()


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_PROC_STATUS = "/proc/self/status"  # Linux: VmHWM and VmRSS


def _rss_kib() -> tuple[int | None, int | None]:
    """(peak RSS, RSS) of this process in KiB: VmHWM and VmRSS from /proc on Linux; elsewhere what the platform
    offers (`_platform_rss_kib`: Windows' peak working set and working set, getrusage's peak on macOS), None for a
    figure it does not give (the report shows it as missing)."""
    hwm = rss = None
    try:
        with open(_PROC_STATUS, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
    except (OSError, ValueError):
        pass
    if hwm is None:
        peak, now = _platform_rss_kib()
        hwm, rss = peak, rss if rss is not None else now
    return hwm, rss


def _platform_rss_kib() -> tuple[int | None, int | None]:
    """(peak, current) resident KiB without /proc: `GetProcessMemoryInfo`'s PeakWorkingSetSize and WorkingSetSize on
    Windows (no `resource` module there), `resource.getrusage`'s ru_maxrss and no current figure elsewhere; (None,
    None) where neither can be read. Never raises."""
    if sys.platform == "win32":
        return _windows_rss_kib()
    try:
        import resource  # POSIX only
    except ImportError:
        return None, None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak // 1024 if sys.platform == "darwin" else peak), None  # macOS: bytes, Linux: KiB


def _windows_rss_kib() -> tuple[int | None, int | None]:
    """(PeakWorkingSetSize, WorkingSetSize) of this process in KiB from psapi's `GetProcessMemoryInfo` (exported by
    kernel32 as K32GetProcessMemoryInfo since Windows 7); (None, None) where it cannot be called."""
    import ctypes

    size_t = ctypes.c_size_t

    class Counters(ctypes.Structure):  # PROCESS_MEMORY_COUNTERS (psapi.h)
        _fields_ = [
            ("cb", ctypes.c_uint32),
            ("PageFaultCount", ctypes.c_uint32),
            ("PeakWorkingSetSize", size_t),
            ("WorkingSetSize", size_t),
            ("QuotaPeakPagedPoolUsage", size_t),
            ("QuotaPagedPoolUsage", size_t),
            ("QuotaPeakNonPagedPoolUsage", size_t),
            ("QuotaNonPagedPoolUsage", size_t),
            ("PagefileUsage", size_t),
            ("PeakPagefileUsage", size_t),
        ]

    try:
        kernel32 = ctypes.WinDLL("kernel32")  # type: ignore[attr-defined,unused-ignore]  # Windows only
        kernel32.GetCurrentProcess.restype = ctypes.c_void_p
        info = kernel32.K32GetProcessMemoryInfo
        info.argtypes = [ctypes.c_void_p, ctypes.POINTER(Counters), ctypes.c_uint32]
        info.restype = ctypes.c_int
        counters = Counters(cb=ctypes.sizeof(Counters))
        if not info(kernel32.GetCurrentProcess(), ctypes.byref(counters), counters.cb):
            return None, None
    except (AttributeError, OSError):  # not Windows (no WinDLL), or no such export
        return None, None
    return counters.PeakWorkingSetSize // 1024, counters.WorkingSetSize // 1024


def run_record(g) -> dict[str, Any]:
    """One generation's run dict as --json stores it and `measure.bench.BenchResult.from_dict` reads it, less its
    place in the schedule. g: a `driver` Result."""
    st = g.stats
    return {
        "tokens_per_s": st.tokens_per_s,
        "n_tokens": st.n_generated,
        "decode_ms": st.decode_ms,
        "n_prompt": st.n_prompt,
        "n_prefill_evaluated": st.n_prefill_evaluated,
        "prefill_ms": st.prefill_ms,
        "draft_prefill_ms": st.draft_prefill_ms,
        "n_drafted": st.n_drafted,
        "n_accepted": st.n_accepted,
        "n_spec_steps": sum(1 for s in g.steps if s.drafted),
        "n_steps": st.n_target_passes,
        "mean_k": st.mean_k,
        "k_histogram": {str(k): v for k, v in sorted(st.k_histogram.items())},
        "draft_ms": st.draft_ms,
        "verify_ms": st.verify_ms,
        "cheap_passes": st.cheap_passes,
        "curve_passes": st.curve_passes,
        "branch_passes": st.branch_passes,
        "batch_histogram": {str(b): v for b, v in sorted(st.batch_histogram.items())},
        "decode_joules": st.energy.decode_j if st.energy is not None else None,  # models.energy: or why not
        "energy_note": st.energy_note,
        "finish_reason": st.finish_reason,
        "tokens": g.tokens,
    }


class _OursRunner:
    """Our engine: one session (target + optional draft model), a drafter per method built once."""

    def __init__(self, msg: dict[str, Any]) -> None:
        from specdec_cli.assemble import Assembler
        from specdec_cli.session import open_session
        from specdec_cli.spec import ModelOptions

        m = msg["models"]
        self.session = open_session(
            # auto includes a draft model as `run` would: a named --draft, or where it pays (draft_policy)
            ModelOptions(
                target=m["target"],
                draft=m["draft"] if m.get("draft_named") else None,
                ctx=m["ctx"],
                threads=m["threads"],
                gpu_layers=m["gpu_layers"],
                verbose=m["verbose"],
            ),
            need_draft=m["draft"] is not None,
        )
        self.assembler = Assembler(self.session)  # every run's engine is fresh, with a drafter that does not learn
        self.k, self.ngram = msg["k"], (msg["ngram_min"], msg["ngram_max"])  # k was checked by the parent
        self.prompts = [self.session.prompt_tokens(t) for t in msg["prompts"]]
        warm = self.session.prompt_tokens(WARMUP_PROMPT)
        self._drafters: dict[str, Any] = {}
        for method in (Method.none, Method.draft) if self.session.draft is not None else (Method.none,):
            self._generate(method, warm, 4)  # page the weights in before anything is timed
        store_tokens = None
        if {"suffix", "auto", "auto-warm"} & {str(m) for m in msg["methods"]}:
            from specdec_cli.config import data_dir
            from specdec_cli.stores.suffix_store import SuffixStore, store_path

            fp = self.session.vocab_fingerprint()
            store_tokens = SuffixStore(store_path(data_dir(), fp), fingerprint=fp).corpus.n_tokens
        self.info = {
            "tokens": [p.tolist() for p in self.prompts],
            "warmup_tokens": warm.tolist(),
            # the chat-templated prompt text, for the native llama.cpp peer (the same ids when it tokenizes)
            "rendered": [self.session.target.format_chat([{"role": "user", "content": t}]) for t in msg["prompts"]],
            "threads": self.session.target.n_threads,
            "suffix_store_tokens": store_tokens,
            "kind": self.session.target.kind,  # a recurrent or hybrid model: the peer cannot run it
            "rss_after_load_kib": _rss_kib()[1],
            "kernels": self.session.kernels(),
        }

    def _drafter(self, method: Method):
        if method is Method.none:
            return None
        if method not in self._drafters:
            from specdec_cli.measure.sweep import NoLearning
            from specdec_cli.spec import SpecOptions

            spec = SpecOptions(method=method, k=self.k, ngram_min=self.ngram[0], ngram_max=self.ngram[1])
            inner = self.assembler.make_drafter(spec)
            assert inner is not None  # (a method that drafts)
            self._drafters[method] = NoLearning(inner)
        return self._drafters[method]

    def _generate(self, method: Method, prompt, max_tokens: int, warm: bool = False):
        """One generation; returns (the `Result`, ms from the call to the first step: TTFT). warm: keep the
        session's --k auto controller (what it learnt from the runs before), as learnt.json carries it."""
        from specdec_cli.core.engine import GenerationConfig
        from specdec_cli.driver import generate
        from specdec_cli.spec import SpecOptions

        # a fresh --k auto per run (unless warm), as the drafters do not learn either: a cold start each time
        engine = self.assembler.engine(
            SpecOptions(method=method, k=self.k), fresh=not warm, drafter=self._drafter(method)
        )
        first: list[float] = []  # perf_counter s when the first step arrived

        def clock(step) -> None:
            if not first:
                first.append(time.perf_counter())

        t0 = time.perf_counter()
        g = generate(engine, prompt, GenerationConfig(max_tokens=max_tokens), clock)
        return g, (first[0] - t0) * 1e3 if first else None

    def run(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg["cold"]:
            self.session.target.truncate(0)
            if self.session.draft is not None:
                self.session.draft.truncate(0)
        reset = _reset_peak_rss()
        g, ttft = self._generate(
            Method(msg["method"]), self.prompts[msg["prompt"]], msg["max_tokens"], warm=msg.get("warm", False)
        )
        hwm, rss = _rss_kib()
        return {
            **run_record(g),
            "ttft_ms": ttft if msg["cold"] else None,
            "peak_rss_kib": hwm,
            "rss_kib": rss,
            "peak_rss_reset": reset,
        }

    def close(self) -> None:
        try:
            self.assembler.close()
        finally:
            self.session.close()


class _PeerRunner:
    """llama-cpp-python's `Llama` with prompt lookup decoding (`specdec_cli.measure.peer.PeerModel`)."""

    def __init__(self, msg: dict[str, Any]) -> None:
        from specdec_cli.measure.peer import PeerModel

        m = msg["models"]
        self.model = PeerModel(
            m["target"], n_ctx=m["ctx"], n_threads=m["threads"], n_gpu_layers=m["gpu_layers"], verbose=m["verbose"]
        )
        self.prompts = msg["prompt_tokens"]
        self.model.generate(msg["warmup_tokens"], num_pred_tokens=10, max_tokens=4, cold=True)
        self.info = {
            "scores_bytes": self.model.scores_nbytes,
            "n_vocab": self.model.n_vocab,
            "n_ctx": m["ctx"],
            "threads": self.model.n_threads,
            "rss_after_load_kib": _rss_kib()[1],
        }

    def run(self, msg: dict[str, Any]) -> dict[str, Any]:
        reset = _reset_peak_rss()
        r = self.model.generate(
            self.prompts[msg["prompt"]],
            num_pred_tokens=msg["num_pred_tokens"],
            max_tokens=msg["max_tokens"],
            cold=msg["cold"],
        )
        hwm, rss = _rss_kib()
        a = r.acceptance
        return {
            "tokens_per_s": r.tokens_per_s,
            "n_tokens": len(r.tokens),
            "decode_ms": r.decode_ms,
            "ttft_ms": r.ttft_ms if msg["cold"] else None,
            "n_prompt": len(self.prompts[msg["prompt"]]),
            "n_drafted": a.n_drafted,
            "n_accepted": a.n_accepted,
            "n_spec_steps": a.n_spec_steps,
            "n_steps": a.n_steps,
            "k_histogram": {str(k): v for k, v in sorted(a.k_histogram.items())},
            "energy_note": "llama-cpp-python's own generation is not metered",
            "finish_reason": r.finish_reason,
            "peak_rss_kib": hwm,
            "rss_kib": rss,
            "peak_rss_reset": reset,
            "tokens": r.tokens,
        }

    def close(self) -> None:
        self.model.close()

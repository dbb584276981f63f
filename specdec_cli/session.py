"""A loaded model pair: `open_session` resolves and loads the target (and, where `draft_policy` says so, a draft
model); the `Session` is what a loaded model is: the backends and their files, the options they were loaded with,
why a draft model is (not) loaded, the chat template and tokenizer, the prompt cache, and the target's verify curve
on this machine (`verify_curve`). Shared by every front end.

Drafters and K controllers are not the session's: `specdec_cli.assemble.Assembler` builds and owns them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from specdec_cli.draft_policy import DraftPlan
from specdec_cli.models.backend import Backend, FimTokens
from specdec_cli.models.devices import Offload
from specdec_cli.spec import Method, ModelOptions
from specdec_cli.stores.prompt_cache import PromptCache

if TYPE_CHECKING:
    from specdec_cli.core.verify_curve import VerifyCurve
    from specdec_cli.models.llama import LlamaBackend
    from specdec_cli.models.resolver import Reporter


@dataclass
class Session:
    """Loaded models. Use `open_session`; close with `close()` (or as a context manager), after the `Assembler`
    that builds engines on it."""

    target: Backend
    target_path: Path
    draft: Backend | None = None
    draft_path: Path | None = None
    options: ModelOptions = field(default_factory=ModelOptions)
    _fingerprint: str | None = None
    draft_plan: DraftPlan = field(default_factory=lambda: DraftPlan(None))  # why a draft model is (not) loaded
    auto_draft: bool = False  # --method auto may draft with the loaded draft model (`draft_policy`: where it pays)
    prompt_cache: PromptCache | None = None  # KV states across runs (`open_session` makes one unless turned off)
    reporter: Reporter | None = None  # where measuring the verify curve shows its progress (`open_session`'s)
    _curve: VerifyCurve | None | Literal[False] = None  # `verify_curve()` once known; False: none to be had
    _text: PromptText | None = None  # `prompt_text()` once built
    draft_ms: float | None = None  # the draft model's measured ms per drafted token (auto on a GPU), None: not timed
    clock: Callable[[], float] = (
        time.perf_counter
    )  # s: what the curve and a draft token are timed with (tests: virtual)
    offload: dict[str, Offload] = field(default_factory=dict)  # "target", "draft": n_gpu_layers each loaded with, why
    _mtp: Any = None  # `mtp_head()` once made; False: the target has no MTP block
    _placement: str | None = None  # `placement()` once known

    def placement(self) -> str:
        """Where the target's passes run, for the keys of what is timed on it (`models.devices.placement`: the device
        and the layers offloaded): "" on a build that cannot offload, and for a target `open_session` did not load
        (no `offload` recorded: a test's fake)."""
        if self._placement is None:
            off = self.offload.get("target")
            if off is None:
                self._placement = ""
            else:
                from specdec_cli.models import devices
                from specdec_cli.models.llama import gpu_offload_supported

                gpu = gpu_offload_supported()
                self._placement = devices.placement(
                    self.target_path, off.layers, gpu=gpu, devs=devices.devices() if gpu else None
                )
        return self._placement

    def curve_key(self) -> str | None:
        """The learnt.json key of the target's verify curve here (`stores.learnt.curve_key`: model file, CPU, threads,
        build, `placement`); None where none is kept (a fake model file, SPECDEC_VERIFY_CURVE=off)."""
        from specdec_cli.stores import learnt

        return learnt.curve_key(self.target_path, self.options.threads, self.placement())

    def verify_curve(self, *, measure: bool = True) -> VerifyCurve | None:
        """The target's measured verify curve on this machine (`core.verify_curve.VerifyCurve`: ms of one pass over
        b tokens, b = 1..65, and its cost per token of context): the one learnt.json keeps (`curve_key`), else, or
        where `stores.learnt.why_measure` gives a reason (stale, provisional, one depth only), measured now
        (`core.verify_timing.measure`: a progress bar on `reporter` that names the reason) and kept;
        with `measure=False` (plain decoding, which needs none) only a kept one. None for a model file that cannot be
        keyed (a fake) or with SPECDEC_VERIFY_CURVE=off. Measuring empties the target's KV cache: the engines ask
        for it before their first generation (`Assembler.engine`)."""
        from specdec_cli.stores import learnt

        if self._curve is None and measure:
            key = self.curve_key()
            kept = learnt.load_curve(key, stale_ok=True)
            why = learnt.why_measure(
                key,
                kept,
                learnt.timed_on(self.options.threads, self.placement()) if key is not None and kept is None else None,
            )
            curve = self._measure_curve(key, why, retry=kept is None or not kept.provisional) if why else kept
            self._curve = curve if curve is not None else False
        elif self._curve is None:
            return learnt.load_curve(self.curve_key())
        return self._curve or None

    def _measure_curve(self, key: str | None, why: str, *, retry: bool = True) -> VerifyCurve:
        """Measure the verify curve now, for the reason `why` (one phrase, shown with the progress bar), and keep it
        under `key`. A measurement the machine disturbed is repeated once after a short wait (`retry`;
        `verify_timing.measure_steady`); one still disturbed is kept as provisional (the next session measures it
        again, once: `retry` False there, and what that one gives is kept as it is)."""
        from dataclasses import replace

        from specdec_cli.core.verify_timing import ATTEMPTS, measure, measure_steady, plan_passes
        from specdec_cli.stores import learnt

        reporter = self.reporter if self.reporter is not None else _QUIET

        def once(**kw) -> VerifyCurve:
            with reporter.progress(
                f"measuring this machine's verify curve: {why}", plan_passes(), unit="steps"
            ) as task:
                return measure(self.target, progress=lambda done, total: task.advance(), clock=self.clock, **kw)

        wait = time.sleep if self.clock is time.perf_counter else None  # a virtual clock has no machine to settle
        curve = measure_steady(
            self.target, attempts=ATTEMPTS if retry else 1, say=reporter.say, measure_fn=once, wait=wait
        )
        curve = replace(curve, measured_for=why, provisional=bool(curve.disturbed) and retry)
        if curve.provisional:
            reporter.say(
                f"verify curve measured in {curve.seconds:.1f} s ({why}) and kept as provisional: "
                f"{curve.disturbed} (the machine was busy); the next run measures it again, once"
            )
        elif curve.disturbed:
            reporter.say(
                f"verify curve measured in {curve.seconds:.1f} s ({why}), the machine still busy "
                f"({curve.disturbed}): kept as it is (specdec doctor --measure times it afresh)"
            )
        else:
            reporter.say(f"verify curve measured in {curve.seconds:.1f} s ({why}) and kept (specdec doctor shows it)")
        learnt.save_curve(key, curve, self.target_path, learnt.timed_on(self.options.threads, self.placement()))
        return curve

    def remeasure_curve(self, why: str) -> VerifyCurve | None:
        """Mark the kept verify curve stale (`why`, one phrase, said on the reporter and kept as its reason) and
        measure it again now (`specdec tune` when the passes it timed disagree with it). None where no curve can be
        kept."""
        from specdec_cli.stores import learnt

        key = self.curve_key()
        if key is None:
            return None
        (self.reporter if self.reporter is not None else _QUIET).say(f"verify curve stale: {why}; measuring it again")
        learnt.forget_curve(key, why)
        self._curve = self._measure_curve(key, f"the kept curve is stale: {why}")
        return self._curve

    def kernels(self) -> dict[str, str]:
        """Which of llama.cpp's kernels the target runs and why, for report headers and --json: {"amx": ...,
        "flash_attn": ...}, each a short phrase (`kernels_line` joins them)."""
        from specdec_cli.models import host
        from specdec_cli.stores import learnt

        plan = host.current_plan()
        if plan is None:
            amx = "unknown (no llama.cpp model loaded)"
        elif not plan.amx_build:
            amx = "not in this build" + (" (the CPU has AMX)" if host.cpu_has_amx() else "")
        else:
            amx = "in use" if plan.extra_bufts else f"off ({plan.reason})"
        fa = getattr(self.target, "flash_attn", None)
        value = os.environ.get(FLASH_ATTN_ENV, "auto").strip().lower()
        if value not in ("auto", ""):
            why = FLASH_ATTN_ENV
        elif learnt.load_flash_attn(learnt.curve_key(self.target_path, self.options.threads)) is not None:
            why = "measured here: specdec doctor shows the times"
        elif fa is False and (crash := self._device_crash()) is not None:
            why = f"llama.cpp's flash attention crashed ({crash}) on a verify pass on this device"
        elif fa is None:
            why = "llama.cpp's default; specdec doctor --measure times it on and off"
        elif fa == "phased":
            why = "the CPU's default where this build can switch it; specdec doctor --measure times it"
        else:
            why = "as the backend was opened"
        return {"amx": amx, "flash_attn": f"{flash_attn_state(fa)} ({why})"}

    def _device_crash(self) -> str | None:
        """What killed llama.cpp's flash attention on this run's device in `host.device_flash_attn`'s remembered
        trial ("SIGSEGV"), or None: no crash known, or nothing offloaded."""
        from specdec_cli.models import host

        off = self.offload.get("target")
        ctx = self.options.ctx
        verdict = host.known_device_flash_attn(self.target_path, off.layers, ctx) if off and off.layers else None
        return verdict.removeprefix("crash: ") if verdict and verdict.startswith("crash") else None

    # -- prompts ------------------------------------------------------------------------------------------------
    def prompt_tokens(self, text: str, *, raw: bool = False, system: str | None = None) -> np.ndarray:
        """int32 [n]: `text` through the target's chat template (with `system`), or as is with `raw`."""
        if raw:
            toks = self.target.tokenize(text, add_special=True, parse_special=False)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            toks = self.chat_tokens(messages)
        return np.asarray(toks, dtype=np.int32)

    def chat_tokens(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None) -> list[int]:
        """Tokens of a chat history rendered with the model's template (special tokens parsed, BOS from the template).

        Args:
            messages: {"role", "content"} dicts; assistant messages may carry `tool_calls` and tool messages
                `tool_call_id` (Hugging Face's chat-template convention).
            tools: OpenAI's tool dicts for templates that describe tools (Qwen2.5's); None = none.
        Raises ToolsUnsupportedError (tools, and a template that never reads them), and what `format_chat` raises.
        """
        return self.tokenize_chat(self.target.format_chat(messages, add_generation_prompt=True, tools=tools))

    def tokenize_chat(self, prompt: str) -> list[int]:
        """Tokens of a rendered chat prompt (special tokens parsed; the template wrote the BOS it wants)."""
        return self.target.tokenize(prompt, add_special=False, parse_special=True)

    def prompt_text(self) -> PromptText:
        """The target's tokenizer and chat template apart from its context (`PromptText`), built once: call it first on
        the thread that loaded the models (a server does, before its worker starts); the object is then usable from
        any thread.

        Raises ModelError: llama.cpp could not load the target's vocabulary again (`models.llama.VocabOnly`)."""
        if self._text is None:
            self._text = PromptText.of(self.target, self.target_path)
            if self._text.vocab is not None and self._fingerprint is None:
                self._fingerprint = self._text.vocab.fingerprint  # read once already: the suffix store's key
        return self._text

    def vocab_fingerprint(self) -> str:
        """The target vocabulary's `VocabInfo.fingerprint` (sha256 hex; read once): the suffix store's key."""
        if self._fingerprint is None:
            self._fingerprint = self.target.vocab_info().fingerprint
        return self._fingerprint

    def prediction_tokens(self, text: str | None) -> tuple[int, ...] | None:
        """A predicted output's target tokens (no special tokens, none parsed), for `GenerationConfig.prediction`;
        None for no prediction."""
        if text is None:
            return None
        return tuple(self.target.tokenize(text, add_special=False, parse_special=False))

    # -- models -------------------------------------------------------------------------------------------------
    def load_draft(self, name: str | None = None, *, reporter: Reporter | None = None) -> None:
        """Resolve and load a draft model later (e.g. `/method draft` in chat): `name`, else `--draft`, else the
        catalog's default draft. Raises ModelError, IncompatiblePairError, ConfigError; the session is then unchanged.
        """
        from specdec_cli.config import load_catalog
        from specdec_cli.models.resolver import resolve

        catalog = load_catalog()
        self.attach_draft(
            resolve(name or self.options.draft or catalog.default_draft, catalog, reporter=reporter), reporter=reporter
        )

    def attach_draft(self, path: Path, *, reporter: Reporter | None = None) -> None:
        """Load the draft model at `path` and check its vocabulary against the target's (closed again on failure)."""
        from specdec_cli.models.host import probe_load
        from specdec_cli.models.vocab import check_compatible

        o = self.options
        probe_load(path, reporter=reporter)  # a file llama.cpp would crash on is refused here, in a child process
        off = gpu_layers(path, o)  # the GPU's memory as the target left it
        with _status(reporter, f"Loading {path.name}"):
            draft = _load(path, o, off.layers, getattr(self.target, "flash_attn", None))  # the target's numerics
        try:
            check_compatible(self.target, draft)
        except BaseException:
            draft.close()
            raise
        self.draft, self.draft_path = draft, path
        self.offload["draft"] = off

    def mtp_head(self) -> Any:
        """The target's MTP block as a drafter's head (`models.llama.LlamaMtp`, `drafters.mtp.MtpHead`), made on
        first use; None where the target has no MTP block (no nextn layers, or a backend that cannot run one).
        Raises ModelError when llama.cpp cannot create the block's context."""
        if self._mtp is None:
            if int(getattr(self.target, "n_nextn", 0)) < 1:
                self._mtp = False
            else:
                from specdec_cli.models.llama import LlamaBackend, LlamaMtp

                self._mtp = LlamaMtp(cast(LlamaBackend, self.target))  # (only llama.cpp's has nextn layers)
        return self._mtp or None

    def close(self) -> None:
        """Free the models (close the `Assembler` first: its drafters may still use the draft model)."""
        try:
            if self._text is not None:
                self._text.close()
            if self._mtp:
                self._mtp.close()
            if self.draft is not None:
                self.draft.close()
        finally:
            self.target.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PromptText:
    """A target's prompts apart from its context: rendering a conversation with the chat template and tokenizing it,
    safe from any thread while another decodes (a server's HTTP side counts tokens and tokenizes requests while its
    worker runs passes; llama-server tokenizes on its HTTP threads the same way). Build it with `Session.prompt_text`.

    For a llama.cpp target the tokenizer is a second, vocabulary-only load of the same file (`models.llama.VocabOnly`:
    no weights, no context, cheap beside the model), so nothing here touches the context or the
    backend the engine drives; the chat template, its BOS/EOS text and the FIM tokens are read once from the target
    at construction. Any other backend (the tests' fakes) is used as it is. One lock of its own serialises tokenizing
    (milliseconds; the decoding thread never takes it). Same vocabulary, same template: the tokens equal the target's
    (`Backend.tokenize`, `Backend.format_chat`).

    Attributes:
        fim: the model's fill-in-the-middle tokens (`Backend.fim_tokens`).
        vocab: the vocabulary's `VocabInfo` where it was read here (a llama.cpp target), else None.
    """

    def __init__(
        self,
        tokenize: Callable[..., list[int]],
        format_chat: Callable[..., str],
        fim: FimTokens,
        *,
        vocab=None,
        close: Callable[[], None] | None = None,
    ) -> None:
        self._tokenize, self._format_chat, self.fim, self.vocab = tokenize, format_chat, fim, vocab
        self._close = close
        self._lock = threading.Lock()

    @classmethod
    def of(cls, target: Backend, path: str | Path) -> PromptText:
        """The prompts of `target` (loaded from `path`). Raises ModelError (the vocabulary-only load failed)."""
        from specdec_cli.models.llama import LlamaBackend, VocabOnly

        if not isinstance(target, LlamaBackend):
            return cls(target.tokenize, target.format_chat, target.fim_tokens())
        vocab = VocabOnly(path)
        try:
            info = vocab.vocab_info()
            format_chat = target.chat_formatter()  # the template and its BOS/EOS text read once, here
        except BaseException:
            vocab.close()
            raise
        return cls(vocab.tokenize, format_chat, target.fim_tokens(), vocab=info, close=vocab.close)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """`Backend.tokenize`: int ids [n] of `text`."""
        with self._lock:
            return self._tokenize(text, add_special=add_special, parse_special=parse_special)

    def fim_tokens(self) -> FimTokens:
        """`Backend.fim_tokens` (read once)."""
        return self.fim

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The text of `Session.chat_tokens`: the chat template rendered, the assistant's generation prompt appended;
        `template_kwargs`: extra template variables (`chat_template_kwargs`), passed only when there are some. Raises
        ToolsUnsupportedError, UsageError (the template refused the conversation), ModelError (it failed)."""
        extra = {"template_kwargs": dict(template_kwargs)} if template_kwargs else {}
        return self._format_chat(messages, add_generation_prompt=True, tools=tools, **extra)

    def tokenize_chat(self, prompt: str) -> list[int]:
        """`Session.tokenize_chat`: tokens of a rendered chat prompt (special tokens parsed)."""
        return self.tokenize(prompt, add_special=False, parse_special=True)

    def close(self) -> None:
        """Free the vocabulary-only load (idempotent); the target is the session's."""
        if self._close is not None:
            self._close()
            self._close = None


def open_session(
    options: ModelOptions,
    *,
    method: Method | str | None = None,
    need_draft: bool = False,
    reporter: Reporter | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Session:
    """Resolve and load the target and, when `method` calls for one (`draft_policy.plan`: `--method draft`; `auto`
    where a draft model pays or `--draft` names one) or `need_draft`, the draft model; check their vocabularies.
    `reporter` shows fetching and loading (`models.resolver.Reporter`; None: notes as plain stderr lines). Each
    model loads with the layers `gpu_layers` gives (all on a GPU build where they fit). `clock` times the passes the
    session measures (the verify curve, a draft token).

    The draft plan is computed once for `method` (for `auto` after the target is resolved: whether `specdec tune`
    measured that a draft model pays needs its file); auto's own plan is asked besides only when another method
    loads a draft model, to know whether a later switch to auto may draft with it (`Session.auto_draft`).

    Raises: ModelError (resolve/load), IncompatiblePairError, ConfigError (catalog), UsageError (`--method draft`
    with a target the catalog pairs with no draft model, before anything is fetched).
    """
    from specdec_cli import draft_policy
    from specdec_cli.config import load_catalog
    from specdec_cli.models.host import probe_load
    from specdec_cli.models.llama import gpu_offload_supported
    from specdec_cli.models.resolver import resolve

    catalog = load_catalog()
    gpu = gpu_offload_supported() and options.gpu_layers != 0
    method = Method(method) if method is not None else None

    def auto_plan(target_path: Path) -> DraftPlan:
        """Whether auto includes a draft model: --draft, a GPU, or specdec tune measured that it pays here."""
        return draft_policy.plan(
            Method.auto,
            options.target,
            options.draft,
            catalog,
            gpu_offload=gpu,
            tuned_pays=draft_policy.tuned_draft_pays(target_path, options.threads),
        )

    if method is None:
        plan = DraftPlan(
            options.draft or draft_policy.paired_draft(options.target, catalog) or catalog.default_draft
            if need_draft
            else None
        )
    elif method is not Method.auto:  # a bad --method draft pairing fails before anything is fetched
        plan = draft_policy.plan(method, options.target, options.draft, catalog, gpu_offload=gpu, tuned_pays=False)
    target_path = resolve(options.target or catalog.default_target, catalog, reporter=reporter)
    if method is Method.auto:
        plan = auto_plan(target_path)
        auto_draft = plan.name is not None
    else:
        auto_draft = plan.name is not None and auto_plan(target_path).name == plan.name
    draft_path = resolve(plan.name, catalog, reporter=reporter) if plan.name is not None else None
    probe_load(target_path, reporter=reporter)  # a file llama.cpp would crash on is refused here, in a child process
    off = gpu_layers(target_path, options)

    def device_probe() -> str:
        from specdec_cli.models import host

        return host.device_flash_attn(target_path, off.layers, options.ctx, reporter=reporter)

    with _status(reporter, f"Loading {target_path.name}"):
        fa = flash_attn(target_path, options.threads, gpu_layers=off.layers, device_probe=device_probe)
        target = _load(target_path, options, off.layers, fa, n_lanes=options.lanes)
    session = Session(
        target=target,
        target_path=target_path,
        options=options,
        draft_plan=plan,
        prompt_cache=PromptCache() if options.prompt_cache else None,
        auto_draft=auto_draft,
        reporter=reporter,
        clock=clock,
        offload={"target": off},
    )
    if draft_path is not None:
        try:
            session.attach_draft(draft_path, reporter=reporter)
            if method is Method.auto and gpu and options.draft is None:
                keep_draft_if_it_pays(session)
        except BaseException:
            session.close()
            raise
    return session


def gpu_layers(path: Path, options: ModelOptions) -> Offload:
    """n_gpu_layers for the model at `path` (`models.devices.offload`): `--gpu-layers` / SPECDEC_GPU_LAYERS when
    given, else all layers on a build that offloads, fewer when the GPUs' free memory (now: what models loaded before
    left) cannot hold them."""
    from specdec_cli.models import devices
    from specdec_cli.models.llama import gpu_offload_supported

    gpu = gpu_offload_supported()
    free = devices.gpu_free(devices.devices()) if gpu and options.gpu_layers == devices.ALL else None
    return devices.offload(path, options.gpu_layers, gpu=gpu, free=free, n_ctx=options.ctx * options.lanes)


def keep_draft_if_it_pays(session: Session) -> None:
    """Auto's paired draft model, loaded because llama.cpp offloads: time one drafted token
    (`verify_timing.measure_token_ms`) and keep the model only when that cost pays against the target's verify curve
    (`draft_policy.draft_pays`); otherwise close it. Either way `draft_plan.reason` gives the ratio. Nothing without
    a verify curve (a model file that cannot be keyed, SPECDEC_VERIFY_CURVE=off)."""
    from specdec_cli import draft_policy
    from specdec_cli.core.cost_model import DEFAULT_K_MAX
    from specdec_cli.core.verify_timing import measure_token_ms

    curve = session.verify_curve()
    if curve is None or session.draft is None:
        return
    session.draft_ms = measure_token_ms(session.draft, clock=session.clock)
    pays, why = draft_policy.draft_pays(session.draft_ms, curve.array(DEFAULT_K_MAX + 1))
    if pays:
        session.draft_plan = DraftPlan(session.draft_plan.name, f"{session.draft_plan.reason}: {why}")
        return
    session.draft.close()
    session.draft, session.draft_path, session.auto_draft = None, None, False
    session.draft_plan = DraftPlan(None, f"{why}; --draft NAME includes it anyway")


FLASH_ATTN_ENV = "SPECDEC_FLASH_ATTN"  # on | off | auto (default: the host's measured choice, else llama.cpp's auto)


def flash_attn(
    target_path: str | Path,
    threads: int | None,
    environ: Mapping[str, str] | None = None,
    *,
    gpu_layers: int | None = None,
    device_probe: Callable[[], str] | None = None,
) -> bool | str | None:
    """Flash attention for the target: SPECDEC_FLASH_ATTN=on/off, else the choice `specdec doctor --measure` made
    on this host for this model and thread count (`measure.flash_attn`), else None: llama.cpp's auto (on wherever the
    backend supports it, the CPU's included). Unmeasured it stays llama.cpp's: its CPU kernel computes each query row
    alone, so a row's attention is the same in a verify batch as in a one-token pass, and greedy speculative output
    matches plain decoding at more near-ties; off, long verify passes can be cheaper on a CPU, but batched and
    one-token attention round differently (tests/models/test_real.py's draft = target at 100 % acceptance fails with it
    off).
    Where the build can switch it between passes (`models.llama.flash_attn_switch`, the patch of `specdec
    install-llama-cpp`) and the model runs on the CPU (a CPU build, or `gpu_layers` 0: the n_gpu_layers this run
    loads it with; None = as the build can, every layer on a GPU build): "phased" (`models.llama.PHASED`: on for
    prefill chunks and short contexts, off for verify passes past `models.llama.PHASE_DEPTH` tokens), unless a
    measurement that timed phased found on cheaper; SPECDEC_FLASH_ATTN=phased asks for it.
    Where the model runs on a device and nothing was measured, `device_probe` (`host.device_flash_attn`, a verdict
    string; None: not asked) decides: off where llama.cpp's flash attention crashed on a verify pass there.
    Raises ConfigError for another value of the variable, or phased on a build that cannot switch."""
    from specdec_cli.errors import ConfigError
    from specdec_cli.models.llama import PHASED, flash_attn_switch, gpu_offload_supported
    from specdec_cli.stores import learnt

    value = (os.environ if environ is None else environ).get(FLASH_ATTN_ENV, "auto").strip().lower()
    if value in ("on", "1", "yes"):
        return True
    if value in ("off", "0", "no"):
        return False
    switch = flash_attn_switch()
    if value == PHASED:
        if not switch:
            raise ConfigError(
                f"{FLASH_ATTN_ENV}=phased needs a llama-cpp-python that can switch flash attention "
                "between passes (a stock build cannot).",
                "Build the patched one with specdec install-llama-cpp, or unset it.",
            )
        return PHASED
    if value not in ("auto", ""):
        raise ConfigError(
            f"{FLASH_ATTN_ENV}={value!r} is not one of on, off, phased, auto.",
            "Unset it (the measured choice), or set it to on, off or phased.",
        )
    on_cpu = gpu_layers == 0 or not gpu_offload_supported()  # what this run offloads, not what the build could
    phased = PHASED if switch and on_cpu else None  # the CPU's default where it can switch
    measured = learnt.load_flash_attn(learnt.curve_key(target_path, threads))
    if measured is None and not on_cpu and device_probe is not None and device_probe().startswith("crash"):
        return False  # the device's kernel dies on a verify pass: llama.cpp's auto would take the run with it
    return flash_attn_choice(measured, phased)


def flash_attn_choice(choice: dict | None, phased: str | None) -> bool | str | None:
    """The setting a measured choice (learnt.json's entry, or None) gives, decided again under today's rule (one kept
    before `OFF_MARGIN` may have chosen off by less): `phased` (`models.llama.PHASED`, or None where the build cannot
    switch or the model is not on the CPU) unless phased was timed and on's turn is cheaper (phased pays on's prefill
    and off's decoding, so an entry timed before phased existed keeps it), else on or off by `prefers_on`; an entry of
    another shape counts as not measured."""
    from specdec_cli.core.verify_timing import prefers_on, prefers_phased

    if choice is None:
        return phased
    try:
        turn = choice["turn_ms"]
        if phased and ("phased" not in turn or prefers_phased(turn)):
            return phased
        return prefers_on(turn)
    except (KeyError, TypeError, ValueError):
        return phased


def flash_attn_state(fa: bool | str | None) -> str:
    """A flash attention setting in words, for `kernels` and doctor."""
    from specdec_cli.models.llama import PHASE_DEPTH, PHASED

    if fa == PHASED:
        return f"on for prefill chunks, off for verify passes past {PHASE_DEPTH:,} tokens of context"
    return "auto" if fa is None else "on" if fa else "off"


def kernels_line(kernels: dict[str, str] | None) -> str:
    """ "AMX kernels: in use; flash attention: off (measured here: ...)" from `Session.kernels` ("" for None)."""
    if not kernels:
        return ""
    return f"AMX kernels: {kernels['amx']}; flash attention: {kernels['flash_attn']}"


class _Quiet:
    """The reporter of a session opened without one: measuring the verify curve shows nothing."""

    def say(self, text: str) -> None:
        pass

    def progress(self, description: str, total: int, *, unit: str = "bytes"):
        from specdec_cli.models.resolver import TextReporter

        return TextReporter().progress(description, total, unit=unit)


_QUIET = _Quiet()


def _load(path: Path, o: ModelOptions, layers: int, flash_attn: Any, n_lanes: int = 1) -> LlamaBackend:
    """A model loaded as `o` says (context, batch, threads, verbosity), `layers` offloaded, with `flash_attn`."""
    from specdec_cli.models.llama import LlamaBackend

    return LlamaBackend(
        path,
        n_ctx=o.ctx,
        n_batch=o.n_batch,
        n_threads=o.threads,
        n_gpu_layers=layers,
        verbose=o.verbose,
        flash_attn=flash_attn,
        n_lanes=n_lanes,
    )


def _status(reporter: Reporter | None, message: str) -> AbstractContextManager[None]:
    return reporter.status(message) if reporter is not None else contextlib.nullcontext()

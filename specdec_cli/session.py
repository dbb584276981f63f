"""Loading a target (and a draft model), building drafters and K controllers: shared by run, chat, tune, bench, check.

The CLI commands stay thin: they parse options into `ModelOptions` / `SpecOptions`, open a `Session`, and hand the
engine's records to the renderer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec_cli.models.backend import Backend
from specdec_cli.models.draft_policy import DraftPlan
from specdec_cli.stores.prompt_cache import PromptCache
from specdec_cli.drafters.base import Drafter
from specdec_cli.errors import UsageError
from specdec_cli.spec import NEEDS_DRAFT_MODEL, USES_DRAFT_MODEL, Method, ModelOptions, SpecOptions

if TYPE_CHECKING:
    from specdec_cli.models.resolver import Reporter


@dataclass
class Session:
    """Loaded models. Use `open_session`; close with `close()` (or as a context manager)."""

    target: Backend
    target_path: Path
    draft: Backend | None = None
    draft_path: Path | None = None
    options: ModelOptions = field(default_factory=ModelOptions)
    _fingerprint: str | None = None
    _controllers: dict = field(default_factory=dict)  # (method, k_max) -> the AdaptiveK that keeps learning
    _drafters: dict = field(default_factory=dict)  # (method, ngram_min, ngram_max) -> the drafter its engines share
    draft_plan: DraftPlan = field(default_factory=lambda: DraftPlan(None))  # why a draft model is (not) loaded
    auto_draft: bool = False  # --method auto may draft with the loaded draft model (`draft_policy`: where it pays)
    prompt_cache: PromptCache | None = None  # KV states across runs (`open_session` makes one unless turned off)

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
        return self.tokenize_chat(self.chat_prompt(messages, tools=tools))

    def chat_prompt(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None) -> str:
        """The text of `chat_tokens`: the chat template rendered, the assistant's generation prompt appended."""
        return self.target.format_chat(messages, add_generation_prompt=True, tools=tools)

    def tokenize_chat(self, prompt: str) -> list[int]:
        """Tokens of a rendered chat prompt (special tokens parsed; the template wrote the BOS it wants)."""
        return self.target.tokenize(prompt, add_special=False, parse_special=True)

    # -- speculation --------------------------------------------------------------------------------------------
    def vocab_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = self.target.vocab_info().fingerprint
        return self._fingerprint

    def drafter(self, spec: SpecOptions) -> Drafter | None:
        """The session's drafter for `spec` (None for method none): built once (`make_drafter`), shared by every
        engine made for this method (a chat's /k, a server's requests), closed by `close`, so a learning drafter
        (the suffix store) learns across them and saves once. Raises what `make_drafter` raises."""
        key = (spec.method, spec.ngram_min, spec.ngram_max)
        if key not in self._drafters:
            self._drafters[key] = self.make_drafter(spec)
        return self._drafters[key]

    def make_drafter(self, spec: SpecOptions) -> Drafter | None:
        """A new drafter for `spec.method` (None for "none"), owned by the caller (`drafter` gives the session's).
        Raises UsageError when the method needs a missing model."""
        method = spec.method
        if method == Method.none:
            return None
        if method == Method.ngram:
            from specdec_cli.drafters.ngram import NgramDrafter

            return NgramDrafter(spec.ngram_min, spec.ngram_max)
        if method in NEEDS_DRAFT_MODEL and self.draft is None:
            raise UsageError(f"--method {method} needs a draft model, and none is loaded.", "Pass --draft NAME.")
        from specdec_cli.drafters.auto import AutoDrafter
        from specdec_cli.drafters.model import ModelDrafter

        if method == Method.draft:
            return ModelDrafter(self.draft)
        if method == Method.predict:
            return AutoDrafter(predictor=self._predictor, name="predict")
        if method in (Method.suffix, Method.auto):
            from specdec_cli.config import data_dir
            from specdec_cli.drafters.suffix import SuffixDrafter
            from specdec_cli.stores.suffix_store import SuffixStore, store_path

            fingerprint = self.vocab_fingerprint()
            suffix = SuffixDrafter(SuffixStore(store_path(data_dir(), fingerprint), fingerprint=fingerprint))
            if method == Method.suffix:
                return suffix
            model = ModelDrafter(self.draft) if self.draft is not None and self.auto_draft else None
            return AutoDrafter(suffix, model, predictor=self._predictor)
        raise AssertionError(f"unhandled method {method}")  # every Method is handled above

    def _predictor(self, prediction: np.ndarray) -> Drafter:
        """The drafter of one generation's predicted output (int32 [m] target tokens)."""
        from specdec_cli.drafters.predict import PredictionDrafter

        target = self.target
        return PredictionDrafter(prediction, piece=target.piece,
                                 tokenize=lambda text: target.tokenize(text, add_special=False, parse_special=False))

    def prediction_tokens(self, text: str | None) -> tuple[int, ...] | None:
        """A predicted output's target tokens (no special tokens, none parsed), for `GenerationConfig.prediction`;
        None for no prediction."""
        if text is None:
            return None
        return tuple(self.target.tokenize(text, add_special=False, parse_special=False))

    def make_controller(self, spec: SpecOptions, *, saved_k: int | None = None, fresh: bool = False):
        """FixedK for a number, AdaptiveK for "auto" (or the K saved by `specdec tune --save`).

        `--k auto` keeps learning across the generations of a session: the same `AdaptiveK` (costs, acceptance by
        match length) serves every generation with this method and k_max, so the second reply of a chat or a
        repeated workload starts where the first left off; and across sessions, through `specdec_cli.stores.learnt`: a new
        one starts from what the last session with these models, method and machine learnt, and `close` saves it.
        `fresh=True` gives a new one that learns from nothing and is not saved (benchmarks of a cold start).
        """
        from specdec_cli.core.controller import AdaptiveK, FixedK

        if spec.fixed_k is not None:
            return FixedK(spec.fixed_k)
        if saved_k is not None:
            return FixedK(saved_k)
        if fresh:
            return AdaptiveK(k_max=spec.k_max)
        key = (spec.method, spec.k_max)
        if key not in self._controllers:
            from specdec_cli.stores import learnt

            ctrl = AdaptiveK(k_max=spec.k_max)
            learnt.restore(ctrl, self._learnt_key(*key))
            self._controllers[key] = ctrl
        return self._controllers[key]

    def _learnt_key(self, method: str, k_max: int) -> str | None:
        from specdec_cli.stores import learnt

        draft = self.draft_path if method in USES_DRAFT_MODEL else None
        return learnt.entry_key(self.target_path, draft, method, self.options.threads, k_max)

    def save_learnt(self) -> None:
        """Save what each `--k auto` controller of this session learnt (`specdec_cli.stores.learnt`; a failure warns)."""
        from specdec_cli.stores import learnt

        keyed, details = {}, {}
        for (method, k_max), ctrl in self._controllers.items():
            key = self._learnt_key(method, k_max) if ctrl.model.steps > 0 else None
            if key is not None:
                keyed[key] = ctrl
                details[key] = {"target": Path(self.target_path).name, "method": method, "k_max": k_max}
        learnt.save(keyed, details)

    # -- models -------------------------------------------------------------------------------------------------
    def load_draft(self, name: str | None = None, *, reporter: Reporter | None = None) -> None:
        """Resolve and load a draft model later (e.g. `/method draft` in chat): `name`, else `--draft`, else the
        catalog's default draft. Raises ModelError, IncompatiblePairError, ConfigError; the session is then unchanged.
        """
        from specdec_cli.config import load_catalog
        from specdec_cli.models.resolver import resolve

        catalog = load_catalog()
        self.attach_draft(resolve(name or self.options.draft or catalog.default_draft, catalog, reporter=reporter),
                          reporter=reporter)

    def attach_draft(self, path: Path, *, reporter: Reporter | None = None) -> None:
        """Load the draft model at `path` and check its vocabulary against the target's (closed again on failure)."""
        from specdec_cli.models.llama import LlamaBackend
        from specdec_cli.models.host import probe_load
        from specdec_cli.models.vocab import check_compatible

        o = self.options
        probe_load(path, reporter=reporter)  # a file llama.cpp would crash on is refused here, in a child process
        with _status(reporter, f"Loading {path.name}"):
            draft = LlamaBackend(path, n_ctx=o.ctx, n_batch=o.n_batch, n_threads=o.threads,
                                 n_gpu_layers=o.gpu_layers, verbose=o.verbose)
        try:
            check_compatible(self.target, draft)
        except BaseException:
            draft.close()
            raise
        self.draft, self.draft_path = draft, path

    def close(self) -> None:
        """Close the session's drafters (learning drafters save what they learnt), save what `--k auto` learnt (a
        failure only warns), then free the models."""
        try:
            for drafter in self._drafters.values():
                if drafter is not None:
                    drafter.close()
            self._drafters.clear()
            self.save_learnt()
        finally:
            if self.draft is not None:
                self.draft.close()
            self.target.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_session(options: ModelOptions, *, method: str | None = None, need_draft: bool = False,
                 reporter: Reporter | None = None) -> Session:
    """Resolve and load the target and, when `method` calls for one (`draft_policy.plan`: `--method draft`; `auto`
    where a draft model pays or `--draft` names one) or `need_draft`, the draft model; check their vocabularies.

    Raises: ModelError (resolve/load), IncompatiblePairError, ConfigError (catalog), UsageError (`--method draft`
    with a target the catalog pairs with no draft model, before anything is fetched).
    """
    from specdec_cli.models import draft_policy
    from specdec_cli.config import load_catalog
    from specdec_cli.models.llama import LlamaBackend, gpu_offload_supported
    from specdec_cli.models.host import probe_load
    from specdec_cli.models.resolver import resolve

    catalog = load_catalog()
    gpu = gpu_offload_supported() and options.gpu_layers != 0
    if method is not None:  # a bad --method draft pairing fails before anything is fetched
        draft_policy.plan(method, options.target, options.draft, catalog, gpu_offload=gpu, tuned_pays=False)
    target_path = resolve(options.target or catalog.default_target, catalog, reporter=reporter)
    # whether auto includes a draft model (a GPU, --draft, or specdec tune measured that it pays here)
    auto_plan = draft_policy.plan("auto", options.target, options.draft, catalog, gpu_offload=gpu,
                                  tuned_pays=draft_policy.tuned_draft_pays(target_path, options.threads))
    if method is not None:
        plan = auto_plan if Method(method) is Method.auto else \
            draft_policy.plan(method, options.target, options.draft, catalog, gpu_offload=gpu, tuned_pays=False)
    else:
        plan = DraftPlan(options.draft or draft_policy.paired_draft(options.target, catalog) or catalog.default_draft
                         if need_draft else None)
    draft_path = resolve(plan.name, catalog, reporter=reporter) if plan.name is not None else None
    probe_load(target_path, reporter=reporter)  # a file llama.cpp would crash on is refused here, in a child process
    with _status(reporter, f"Loading {target_path.name}"):
        target = LlamaBackend(target_path, n_ctx=options.ctx, n_batch=options.n_batch, n_threads=options.threads,
                              n_gpu_layers=options.gpu_layers, verbose=options.verbose)
    from specdec_cli.stores.prompt_cache import PromptCache

    session = Session(target=target, target_path=target_path, options=options, draft_plan=plan,
                      prompt_cache=PromptCache() if options.prompt_cache else None,
                      auto_draft=auto_plan.name is not None and auto_plan.name == plan.name)
    if draft_path is not None:
        try:
            session.attach_draft(draft_path, reporter=reporter)
        except BaseException:
            session.close()
            raise
    return session


def _status(reporter: Reporter | None, message: str) -> AbstractContextManager[None]:
    return reporter.status(message) if reporter is not None else contextlib.nullcontext()

"""The compile lock: keeps drafter threads from tripping over each other's torch.compile.

The race: `torch.fx._symbolic_trace._is_fx_tracing_flag` is ONE process-global flag, set while any
thread FX-traces inside a compile. The torch.compile wrapper refuses to run while it is set, so a thread
that merely CALLS compiled code next to a compiling thread raises metrics_format.FX_TRACING_ERROR (or hangs).

The fix: a reader/writer lock around each drafter thread's forward+backward, and nothing else (a
gradient barrier inside it would deadlock against a thread waiting for the exclusive lock).
- A step that may compile holds it EXCLUSIVE: the thread's first step, a new shape_key for the
  thread, or any step after a compile nobody predicted. Other steps hold it SHARED (in parallel).
- Every compile is caught as it starts (we wrap dynamo's compile-callback scope, which the forward and
  the lazy backward compile both enter): inside a shared step it upgrades the step to exclusive before
  tracing begins. Each is logged with thread, step, reason and duration.
- `carry_step(fn)`: an activation-checkpoint recompute belongs to the step that ran its forward
  (on CUDA it runs in the GPU's autograd thread, which adopts that step). A recompute that
  compiles beside another step on the SAME GPU cannot wait: that step's backward is queued on
  this very thread. It is logged as not exclusive and every thread's next step is exclusive.

`MASK_LOCK`: create_block_mask adds and deletes a key in a module-global dict that another
create_block_mask, or a compile, also changes (`KeyError: 'custom'`). masks.build_block_mask holds
it, and in mode "lock" every compile does too. Build masks with `_compile=False`: a compile under
MASK_LOCK would wait for steps that wait for MASK_LOCK.
`assert_fx_flag_clear()`: an EAGER flex_attention call can restore a stale True into the flag,
poisoning every later compiled call; never mix it into a compiled run.
`error_on_nested_fx_trace=False` is no fix (compiled code silently runs eager): refused.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from trainer.metrics_format import FX_TRACING_ERROR

# run.compile_lock's modes, each with its line in the startup summary
COMPILE_LOCK_MODES = {
    "lock": "exclusive for first/new-shape/compiling steps, shared otherwise",
    "none": "UNPROTECTED (race harness only)",
    "patch": "is_fx_symbolic_tracing patched to False (experiment)",
}

# Serialises create_block_mask, and (mode "lock") keeps it apart from compiles; re-entrant for a
# compile started by the thread that holds it.
MASK_LOCK = threading.RLock()

DEFAULT_WAIT_TIMEOUT_S = 900.0


class CompileLockError(RuntimeError):
    """The compile lock found the process in a state where compiled code cannot run safely."""


class CompileLockTimeout(CompileLockError):
    """Waited too long for other threads to leave their steps (a step is blocked on something)."""


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or while handling, each once (torch wraps errors)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_fx_tracing_error(exc: BaseException | None) -> bool:
    """True for the FX-tracing race's error, however torch wrapped it."""
    return any(FX_TRACING_ERROR in str(link) for link in exception_chain(exc))


def assert_fx_flag_clear() -> None:
    """Raise if the FX-tracing flag is set while no compile runs (call it between steps)."""
    import torch.fx._symbolic_trace as symbolic_trace

    if symbolic_trace._is_fx_tracing_flag:
        raise CompileLockError(
            "torch.fx._symbolic_trace._is_fx_tracing_flag is stuck True outside any compile: every "
            "compiled call will now fail. Usual cause: an eager (uncompiled) flex_attention call "
            "in a process that also runs compiled code. Fix: call flex_attention only through the "
            "one torch.compile(flex_attention) wrapper (or use --attention sdpa)."
        )


def assert_nested_fx_error_enabled() -> None:
    import torch._dynamo

    if not torch._dynamo.config.error_on_nested_fx_trace:
        raise CompileLockError(
            "torch._dynamo.config.error_on_nested_fx_trace is False: compiled functions hit by the "
            "FX-tracing race would silently run EAGER (slow, and hides the bug). Remove that setting; "
            "the compile lock (--compile-lock lock) is the fix."
        )


class SharedExclusiveLock:
    """Reader/writer lock; waiting writers block new readers so a compile is never starved. A wait times
    out only after `timeout` seconds without any release (queued first compiles take longer)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.readers = 0  # steps holding it shared (read anywhere, changed under _cond only)
        self.writer: int | None = None  # the thread holding it exclusively
        self._writers_waiting = 0
        self._releases = 0  # progress counter for the timeouts
        self.writer_context: _StepContext | None = None

    def _wait_until(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Condition wait (lock held) whose deadline restarts whenever someone releases."""
        seen, deadline = self._releases, time.monotonic() + timeout
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._cond.wait(remaining)
            if self._releases != seen:
                seen, deadline = self._releases, time.monotonic() + timeout
        return True

    def acquire_shared(self, timeout: float) -> None:
        with self._cond:
            if not self._wait_until(lambda: self.writer is None and self._writers_waiting == 0, timeout):
                raise CompileLockTimeout(
                    f"no step finished for {timeout:.0f} s while waiting for a compiling step; is a "
                    "thread stuck inside guard.step()?"
                )
            self.readers += 1

    def release_shared(self) -> None:
        with self._cond:
            self.readers -= 1
            self._releases += 1
            if self.readers == 0:
                self._cond.notify_all()

    def acquire_exclusive(self, timeout: float, context: _StepContext | None = None) -> None:
        with self._cond:
            self._writers_waiting += 1
            try:
                free = self._wait_until(lambda: self.writer is None and self.readers == 0, timeout)
            finally:
                self._writers_waiting -= 1
            if not free:
                self._cond.notify_all()  # readers held back by our wait may go on
                raise CompileLockTimeout(
                    f"no step finished for {timeout:.0f} s while waiting for {self.readers} other "
                    "step(s) before compiling; is a thread blocked inside guard.step() (a barrier or "
                    "queue belongs AFTER the guarded forward+backward)?"
                )
            self.writer, self.writer_context = threading.get_ident(), context

    def release_exclusive(self) -> None:
        with self._cond:
            self.writer = self.writer_context = None
            self._releases += 1
            self._cond.notify_all()


@dataclass
class _StepContext:
    thread: str
    step: int
    shape_key: tuple
    hold: str | None = None  # "shared" | "exclusive" | None
    reason: str = "ordinary_step"
    device: str | None = None  # None: unknown (treated as shared with every other step)


_tls = threading.local()
_hook_lock = threading.Lock()
_active_guard: CompileGuard | None = None
_hook_kind: str | None = None  # "scope" (wrapped install_callbacks) | "callbacks" | None


class CompileGuard:
    """install() before anything is compiled, then `with guard.step(...)` around each forward+backward
    (barrier and optimizer after it). A subclass (a benchmark) may offer other `modes` and decide which
    steps run alone (`exclusive_reason`); its modes get none of "lock"'s other protections."""

    modes: dict[str, str] = COMPILE_LOCK_MODES

    def __init__(
        self,
        mode: str = "lock",
        on_event: Callable[[dict], None] | None = None,
        wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> None:
        if mode not in self.modes:
            raise ValueError(
                f"compile_lock mode {mode!r} is not one of {', '.join(self.modes)}; use 'lock' (the fix) "
                "unless you are measuring the race"
            )
        self.mode = mode
        self.on_event = on_event
        self.wait_timeout_s = wait_timeout_s
        self.events: list[dict] = []
        self._events_lock = threading.Lock()
        self._lock = SharedExclusiveLock()
        self._state_lock = threading.Lock()
        self._threads_seen: set[str] = set()
        self._shapes_seen: set[tuple[str, tuple]] = set()
        self._escalated: set[str] = set()  # threads whose next step must be exclusive
        self._compiles_running = 0
        self._active: dict[int, _StepContext] = {}  # steps inside the guard, by id

    def install(self) -> CompileGuard:
        global _active_guard
        import torch

        assert_nested_fx_error_enabled()
        if self.mode == "patch":
            from torch._dynamo.utils import counters

            if counters["stats"]["unique_graphs"] > 0:
                raise CompileLockError(
                    "compile_lock 'patch' installed after torch.compile already ran: the wrapper "
                    "captured the unpatched is_fx_symbolic_tracing. Install the guard first."
                )
            torch.fx._symbolic_trace.is_fx_symbolic_tracing = _never_fx_tracing
        _install_compile_hook()
        _active_guard = self
        return self

    @property
    def compile_hook(self) -> str | None:
        """How compiles are detected: "scope" (can lock), "callbacks" (log only) or None."""
        return _hook_kind

    def describe(self) -> str:
        what = self.modes[self.mode]
        return f"compile lock: {self.mode} ({what}; compile detection: {_hook_kind or 'off'})"

    @contextlib.contextmanager
    def step(
        self, thread_name: str, step: int, shape_key: tuple, device: str | None = None
    ) -> Iterator[None]:
        """Hold around one thread's whole forward+backward (nothing that waits on other threads).
        `device` (None: unknown) tells a checkpoint recompute which other steps share its GPU."""
        if getattr(_tls, "context", None) is not None:
            raise CompileLockError(
                f"guard.step() entered twice in thread {thread_name!r}; wrap one forward+backward"
            )
        assert_nested_fx_error_enabled()
        context = _StepContext(thread_name, step, tuple(shape_key), device=device)
        self._enter(context)
        _tls.context = context
        with self._state_lock:
            self._active[id(context)] = context
        completed = False
        try:
            yield
            completed = True
        finally:
            with self._state_lock:
                self._active.pop(id(context), None)
            _tls.context = None
            self._exit(context, completed)

    def has_completed_a_step(self, thread_name: str) -> bool:
        with self._state_lock:
            return thread_name in self._threads_seen

    def exclusive_reason(self, context: _StepContext) -> str | None:
        """Why this step must run alone, or None: shared in mode "lock", unguarded otherwise."""
        if self.mode != "lock":
            return None
        with self._state_lock:
            if context.thread not in self._threads_seen:
                return "first_step"
            if (context.thread, context.shape_key) not in self._shapes_seen:
                return "new_shape"
            if context.thread in self._escalated:
                return "after_unpredicted_compile"
        return None

    def _enter(self, context: _StepContext) -> None:
        reason = self.exclusive_reason(context)
        if reason is not None:
            self._lock.acquire_exclusive(self.wait_timeout_s, context)
            context.hold, context.reason = "exclusive", reason
            # Alone now, and no compile runs: a set flag can only be a stuck one.
            if self.mode == "lock" and self._compiles_running == 0:
                try:
                    assert_fx_flag_clear()
                except CompileLockError:
                    self._lock.release_exclusive()  # the other threads must not hang on us
                    context.hold = None
                    raise
        elif self.mode == "lock":
            self._lock.acquire_shared(self.wait_timeout_s)
            context.hold = "shared"

    def _exit(self, context: _StepContext, completed: bool) -> None:
        if context.hold == "exclusive":
            self._lock.release_exclusive()
        elif context.hold == "shared":
            self._lock.release_shared()
        context.hold = None
        if completed:  # a failed step stays "may compile" for its retry
            with self._state_lock:
                self._threads_seen.add(context.thread)
                self._shapes_seen.add((context.thread, context.shape_key))
                if context.reason != "ordinary_step":
                    self._escalated.discard(context.thread)

    @contextlib.contextmanager
    def _compile_scope(self, trigger: str, compile_id: str) -> Iterator[None]:
        """Runs in the compiling thread around each dynamo/AOT compile, BEFORE any tracing."""
        if getattr(_tls, "compiling", False):  # nested in a compile this thread already holds and logs
            yield
            return
        context = getattr(_tls, "context", None)
        owner, reason, took_exclusive = self._claim_for_compile(context)
        # Whether this compile ran with no other thread inside a step (the invariant of "lock").
        exclusive = took_exclusive or (owner is not None and owner.hold == "exclusive")
        holds_mask_lock = self.mode == "lock" and MASK_LOCK.acquire(timeout=self.wait_timeout_s)
        if self.mode == "lock" and not holds_mask_lock:
            if took_exclusive:
                self._lock.release_exclusive()
            raise CompileLockTimeout(
                f"waited {self.wait_timeout_s:.0f} s for MASK_LOCK before compiling; is "
                "create_block_mask compiling (_compile=True) while holding it?"
            )
        _tls.compiling = True
        with self._state_lock:
            self._compiles_running += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            duration = time.perf_counter() - started
            with self._state_lock:
                self._compiles_running -= 1
            _tls.compiling = False
            if holds_mask_lock:
                MASK_LOCK.release()
            if took_exclusive:
                self._lock.release_exclusive()
            self._record(
                owner,
                duration_s=round(duration, 4),
                reason=reason,
                exclusive=exclusive,
                shape_key=list(owner.shape_key) if owner else None,
                trigger=trigger,
                compile_id=compile_id,
                phase=getattr(_tls, "phase", None) or "step",
            )

    def _claim_for_compile(self, context: _StepContext | None) -> tuple[_StepContext | None, str, bool]:
        """Make sure nobody else is inside a step while this thread compiles (mode lock).
        Returns (the step this compile belongs to, reason, whether we took the lock here)."""
        if context is not None:
            if self.mode == "lock" and context.hold == "shared":
                if getattr(_tls, "adopted", False) and self._others_share_device(context):
                    # A recompute beside other steps on its GPU: their backward waits on this thread.
                    self._escalate()
                    return context, "recompute_beside_same_device_steps", False
                # Unpredicted: trade the shared hold for exclusive (barriers sit outside the guard).
                self._lock.release_shared()
                context.hold = None
                with _dynamo_compile_lock_released():
                    self._lock.acquire_exclusive(self.wait_timeout_s, context)
                context.hold, context.reason = "exclusive", "unpredicted"
                self._escalate()
            return context, context.reason, False
        # No step here: a lazy backward compile in autograd's device thread is the exclusive step's.
        writer = self._lock.writer_context
        if self._lock.writer is not None and writer is not None:
            return writer, writer.reason, False
        if self.mode != "lock":
            return None, "outside_step", False
        if self._lock.readers == 0:
            with _dynamo_compile_lock_released():
                self._lock.acquire_exclusive(self.wait_timeout_s, None)
            return None, "outside_step", True
        # This thread may serve running shared steps' backward: waiting could deadlock, so escalate.
        self._escalate()
        return None, "unguarded_during_shared_steps", False

    def _others_share_device(self, context: _StepContext) -> bool:
        with self._state_lock:
            return any(
                other is not context
                and (other.device is None or context.device is None or other.device == context.device)
                for other in self._active.values()
            )

    def _escalate(self) -> None:
        with self._state_lock:
            self._escalated.update(self._threads_seen)

    def _record(self, owner: _StepContext | None, **fields) -> None:
        """Log one compile, attributed to `owner`'s step (None: outside any step)."""
        event = {
            "event": "compile",
            "thread": owner.thread if owner else threading.current_thread().name,
            "step": owner.step if owner else -1,
            **fields,
            "os_thread": threading.current_thread().name,
            "time": time.time(),
        }
        with self._events_lock:
            self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def uninstall(self) -> None:
        """Stop routing compile events here (a patch stays: wrappers captured it)."""
        global _active_guard
        if _active_guard is self:
            _active_guard = None


@contextlib.contextmanager
def _dynamo_compile_lock_released() -> Iterator[None]:
    """Let go of dynamo's re-entrant compile_lock (held around our compile scope) while waiting for
    the other steps: one of them may need to compile too (measured: recomputes hung without this)."""
    lock: Any = None
    try:
        from torch._dynamo import convert_frame

        lock = getattr(convert_frame, "compile_lock", None)
    except ImportError:
        pass
    if not getattr(lock, "_is_owned", lambda: False)():
        yield
        return
    state = lock._release_save()
    try:
        yield
    finally:
        lock._acquire_restore(state)


def compile_reason(event: dict) -> str:
    """A compile event's reason for the log: why it may compile, where, and whether it ran alone."""
    recompute = ", in checkpoint recompute" if event.get("phase") == "recompute" else ""
    alone = ", NOT exclusive" if event.get("exclusive") is False else ""
    return event.get("reason", "") + recompute + alone


def carry_step(fn: Callable) -> Callable:
    """Wrap a function for torch.utils.checkpoint: the first call is the forward; later calls are
    backward's recomputes, perhaps in a GPU's autograd thread, which adopts the current step's context
    so a compile there follows the step's rules."""
    context = getattr(_tls, "context", None)
    calls = 0

    def run(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args, **kwargs)
        previous_phase = getattr(_tls, "phase", None)
        adopt = context is not None and getattr(_tls, "context", None) is None
        _tls.phase = "recompute"
        if adopt:
            _tls.context, _tls.adopted = context, True
        try:
            return fn(*args, **kwargs)
        finally:
            _tls.phase = previous_phase
            if adopt:
                _tls.context, _tls.adopted = None, False

    return run


def _never_fx_tracing() -> bool:
    return False


def _install_compile_hook() -> None:
    """Route every dynamo / lazy-backward compile through the active guard (once per process), by
    wrapping the scope both enter. Start/end callbacks run under the handler's lock and fire only for
    the first of overlapping compiles (no blocking, no attribution): a log-only fallback."""
    global _hook_kind
    with _hook_lock:
        if _hook_kind is not None:
            return
        import torch._dynamo

        handler = torch._dynamo.callback_handler
        original = getattr(handler, "install_callbacks", None)
        if original is not None:

            @contextlib.contextmanager
            def install_callbacks(*args, **kwargs):
                guard = _active_guard
                trigger = kwargs.get("trigger", args[0] if args else None)
                trigger_name = getattr(trigger, "name", str(trigger))
                compile_id = str(kwargs.get("compile_id", args[1] if len(args) > 1 else ""))
                scope = guard._compile_scope(trigger_name, compile_id) if guard else contextlib.nullcontext()
                with scope, original(*args, **kwargs):
                    yield

            try:
                # deliberate: torch's handler method replaced by our wrapper (see the docstring)
                handler.install_callbacks = install_callbacks  # type: ignore[method-assign]
                _hook_kind = "scope"
                return
            except (AttributeError, TypeError):
                pass
        handler.register_start_callback(_callback_started)
        handler.register_end_callback(_callback_ended)
        _hook_kind = "callbacks"


def _callback_started(args) -> None:  # fallback detection: log only
    _tls.callback_started = time.perf_counter()


def _callback_ended(args) -> None:
    guard, started = _active_guard, getattr(_tls, "callback_started", None)
    if guard is None:
        return
    context = getattr(_tls, "context", None)
    guard._record(
        context,
        duration_s=round(time.perf_counter() - started, 4) if started else None,
        reason=context.reason if context else "outside_step",
        trigger=getattr(getattr(args, "callback_trigger", None), "name", ""),
        compile_id=str(getattr(args, "compile_id", "")),
    )

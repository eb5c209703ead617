"""decodev2 through ctypes: a thin Pythonic wrapper over include/decodev2.h.

Install with `pip install ./python` (builds the library with cargo and bundles it), or use it
from a checkout. The shared library is found through $DV2_LIB (a file path) when set, else
beside this file (an installed package), else in target/release of the repository this file
lives in.

    from decodev2 import Engine
    with Engine.synthetic("tiny_llama", seed=0, backend="cpu") as e:
        first = e.prefill([1, 2, 3])
        ids = e.step_n(8)
"""
import collections
import ctypes
import os
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
BACKENDS = {"auto": 0, "cpu": 1, "cuda": 2}
DV2_OK, DV2_FINISHED, DV2_ERR_BUFFER_TOO_SMALL = 0, 5, 17
DV2_TOKENIZE_ADD_SPECIAL, DV2_TOKENIZE_PARSE_SPECIAL, DV2_DETOKENIZE_SKIP_SPECIAL = 1, 2, 1


def _find_library():
    env = os.environ.get("DV2_LIB")
    if env:
        return env
    for candidate in (_HERE / "libdecodev2.so", _HERE.parent.parent / "target" / "release" / "libdecodev2.so"):
        if candidate.exists():
            return str(candidate)
    raise OSError("libdecodev2.so not found: set DV2_LIB, pip install the package, or run `cargo build --release`")


class Options(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("backend", ctypes.c_int32), ("max_seq", ctypes.c_int32),
                ("eos_id", ctypes.c_int32), ("device", ctypes.c_int32)]


class ModelInfo(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32)] + [
        (name, ctypes.c_int32) for name in ("n_layers", "hidden", "n_q_heads", "n_kv_heads", "head_dim",
                                             "intermediate", "vocab", "max_seq", "backend")]


class Sampling(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("temperature", ctypes.c_float), ("top_k", ctypes.c_int32),
                ("top_p", ctypes.c_float), ("min_p", ctypes.c_float), ("repeat_penalty", ctypes.c_float),
                ("presence_penalty", ctypes.c_float), ("frequency_penalty", ctypes.c_float),
                ("penalty_last_n", ctypes.c_int32), ("seed", ctypes.c_uint64)]


class ChatMessage(ctypes.Structure):
    _fields_ = [("role", ctypes.c_char_p), ("content", ctypes.c_char_p)]


lib = ctypes.CDLL(_find_library())
_P = ctypes.c_void_p
_I32P = ctypes.POINTER(ctypes.c_int32)
for name, restype, argtypes in [
    ("dv2_version", ctypes.c_char_p, []),
    ("dv2_last_error", ctypes.c_char_p, []),
    ("dv2_status_name", ctypes.c_char_p, [ctypes.c_int]),
    ("dv2_options_default", Options, []),
    ("dv2_load", ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(Options), ctypes.POINTER(_P)]),
    ("dv2_load_synthetic", ctypes.c_int, [ctypes.c_char_p, ctypes.c_uint64, ctypes.POINTER(Options), ctypes.POINTER(_P)]),
    ("dv2_free", None, [_P]),
    ("dv2_reset", ctypes.c_int, [_P]),
    ("dv2_rewind", ctypes.c_int, [_P, ctypes.c_int32]),
    ("dv2_state_save_file", ctypes.c_int, [_P, ctypes.c_char_p]),
    ("dv2_state_load_file", ctypes.c_int, [_P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                                           ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_state_save_data", ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_state_load_data", ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int32),
                                           ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_prefill", ctypes.c_int, [_P, _I32P, ctypes.c_size_t, _I32P]),
    ("dv2_step", ctypes.c_int, [_P, _I32P]),
    ("dv2_step_n", ctypes.c_int, [_P, ctypes.c_size_t, _I32P, ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_next_token", ctypes.c_int, [_P, _I32P]),
    ("dv2_logits", ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t]),
    ("dv2_logprobs", ctypes.c_int, [_P, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_float), _I32P,
                                    ctypes.POINTER(ctypes.c_float)]),
    ("dv2_position", ctypes.c_int, [_P, _I32P]),
    ("dv2_finished", ctypes.c_int, [_P, _I32P]),
    ("dv2_get_model_info", ctypes.c_int, [_P, ctypes.POINTER(ModelInfo)]),
    ("dv2_tokenize", ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32, _I32P, ctypes.c_size_t,
                                    ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_detokenize", ctypes.c_int, [_P, _I32P, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_size_t,
                                      ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_token_to_piece", ctypes.c_int, [_P, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t,
                                          ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_sampling_default", Sampling, []),
    ("dv2_set_sampling", ctypes.c_int, [_P, ctypes.POINTER(Sampling)]),
    ("dv2_set_logit_bias", ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float),
                                          ctypes.c_size_t]),
    ("dv2_set_speculation", ctypes.c_int, [_P, ctypes.c_int32]),
    ("dv2_step_draft", ctypes.c_int, [_P, _I32P, ctypes.c_size_t, _I32P, ctypes.c_size_t,
                                      ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_speculation_stats", ctypes.c_int, [_P] + [ctypes.POINTER(ctypes.c_uint64)] * 3),
    ("dv2_token_special", ctypes.c_int, [_P, ctypes.c_int32, _I32P]),
    ("dv2_token_is_eog", ctypes.c_int, [_P, ctypes.c_int32, _I32P]),
    ("dv2_meta_str", ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                    ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_meta_count", ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_meta_key", ctypes.c_int, [_P, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t,
                                    ctypes.POINTER(ctypes.c_size_t)]),
    ("dv2_chat_apply_template", ctypes.c_int, [_P, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32,
                                               ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
]:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes


class Dv2Error(RuntimeError):
    """A failing call: `status` is the dv2_status name, the message is dv2_last_error(). Each
    status raises its subclass below; catch Dv2Error for any of them."""

    def __init__(self, status, call):
        self.status = lib.dv2_status_name(status).decode()
        self.code = status
        super().__init__(f"{call}: {self.status}: {lib.dv2_last_error().decode()}")


class InvalidArgumentError(Dv2Error, ValueError):
    """NULL_POINTER, INVALID_ARGUMENT, INVALID_SPEC, UNKNOWN_PRESET, ABI_MISMATCH, QUANTIZE."""


class InvalidStateError(Dv2Error):
    """A call out of order (e.g. a step before any prefill)."""


class SequenceFullError(Dv2Error):
    """The request has reached max_seq."""


class FinishedError(Dv2Error):
    """A step after the end of generation (until reset)."""


class UnsupportedError(Dv2Error):
    """A model or setting decodev2 does not compute."""


class ModelFileError(Dv2Error, OSError):
    """IO and MODEL_FILE: a missing, unreadable or malformed model file."""


class BackendUnavailableError(Dv2Error):
    """No CUDA driver or device (or one too old)."""


class OutOfMemoryError(Dv2Error, MemoryError):
    """The model does not fit the device (the message gives both sizes)."""


class NonFiniteError(Dv2Error, ArithmeticError):
    """The logits hold inf or NaN."""


class StateFileError(Dv2Error, OSError):
    """A state file (save_state) that is not one, is truncated, or is of another model."""


class BufferTooSmallError(Dv2Error):
    """An output buffer too small (the wrapper sizes its buffers; not seen through it)."""


_ERRORS = {1: InvalidArgumentError, 2: InvalidArgumentError, 3: InvalidStateError, 4: SequenceFullError,
           5: FinishedError, 6: InvalidArgumentError, 7: UnsupportedError, 8: ModelFileError, 9: ModelFileError,
           10: BackendUnavailableError, 11: OutOfMemoryError, 13: InvalidArgumentError, 14: InvalidArgumentError,
           15: InvalidArgumentError, 16: NonFiniteError, 17: BufferTooSmallError, 18: StateFileError}


def _int32(values, what):
    """`values` (ints) as the library's int32 arguments take them: ctypes would keep only the
    low 32 bits of one outside int32 (2**32 + 5 would become id 5), so such a value is a
    ValueError here."""
    for v in values:
        if not -(1 << 31) <= v < (1 << 31):
            raise ValueError(f"{what} {v} is outside int32")
    return values


def _check(status, call):
    if status != DV2_OK:
        raise _ERRORS.get(status, Dv2Error)(status, call)


LOG_LEVELS = {0: "error", 1: "warn", 2: "info", 3: "debug"}
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
lib.dv2_set_log_callback.restype = None
lib.dv2_set_log_callback.argtypes = [_LOG_CALLBACK, ctypes.c_void_p]
_log_sink = None  # the ctypes thunk the library holds; kept alive here


def set_log_callback(callback):
    """Routes the library's log lines to callback(level, message) ("error", "warn", "info",
    "debug"); None stops them. Exceptions inside the callback are printed, never raised into
    the library."""
    global _log_sink

    def sink(level, message, _user):
        try:
            callback(LOG_LEVELS.get(level, str(level)), message.decode(errors="replace"))
        except Exception:  # noqa: BLE001 - nothing may unwind into C
            import traceback

            traceback.print_exc()

    _log_sink = _LOG_CALLBACK(sink) if callback else _LOG_CALLBACK()
    lib.dv2_set_log_callback(_log_sink, None)


def version():
    return lib.dv2_version().decode()


# Decoding runs in dv2_step_n batches that take about this long, so that the host leaves the
# token loop (a step a call cost ~0.11 ms a token over step_n on the H200 in Python, docs/lab.md
# session 25) while a stream still moves in small bursts; 1 where a step takes longer.
BURST_S = 0.02
MAX_BATCH = 32


def next_batch(done, since):
    """The next batch's size from the time the last `done` ids took, and the clock now."""
    now = time.perf_counter()
    per_id = (now - since) / max(done, 1)
    return max(1, min(MAX_BATCH, int(BURST_S / per_id) if per_id > 0 else MAX_BATCH)), now


class Engine:
    """One model, one request at a time. Not thread-safe; one thread per Engine."""

    def __init__(self, handle):
        self._h = handle
        # The ids at the request's positions (what its KV cache holds), and the pending id.
        self._fed, self._pending = [], None
        self.reused = 0  # positions the last start() kept from the request before
        info = ModelInfo(struct_size=ctypes.sizeof(ModelInfo))
        _check(lib.dv2_get_model_info(self._h, ctypes.byref(info)), "dv2_get_model_info")
        self.info = info

    @staticmethod
    def _options(backend, max_seq, eos_id):
        opts = lib.dv2_options_default()
        opts.backend = BACKENDS[backend]
        opts.max_seq, opts.eos_id = _int32([max_seq, eos_id], "max_seq or eos_id")
        return opts

    @classmethod
    def synthetic(cls, preset, seed=0, backend="auto", max_seq=0, eos_id=-1):
        h = _P()
        opts = cls._options(backend, max_seq, eos_id)
        if not 0 <= seed < 1 << 64:
            raise ValueError(f"seed {seed} is outside uint64")
        _check(lib.dv2_load_synthetic(preset.encode(), seed, ctypes.byref(opts), ctypes.byref(h)), "dv2_load_synthetic")
        return cls(h)

    @classmethod
    def load(cls, path, backend="auto", max_seq=0, eos_id=-1):
        h = _P()
        opts = cls._options(backend, max_seq, eos_id)
        _check(lib.dv2_load(os.fsencode(path), ctypes.byref(opts), ctypes.byref(h)), "dv2_load")
        return cls(h)

    def close(self):
        if self._h:
            lib.dv2_free(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    @property
    def backend(self):
        return {v: k for k, v in BACKENDS.items()}[self.info.backend]

    def reset(self):
        _check(lib.dv2_reset(self._h), "dv2_reset")
        self._fed, self._pending = [], None

    def rewind(self, position):
        """Moves the request back to `position` (at most position()), keeping the KV cache of
        the positions before it; a prefill comes next (see dv2_rewind)."""
        _check(lib.dv2_rewind(self._h, *_int32([position], "position")), "dv2_rewind")
        del self._fed[position:]
        self._pending = None

    def save_state(self, path):
        """Saves the request to the file at `path`: the ids at its positions and their KV cache
        (not the pending id). load_state puts it back, in this process or a later one, on either
        backend, so that a long prompt is prefilled once. Returns the positions saved; a failed
        save leaves an earlier file at `path` whole (see dv2_state_save_file)."""
        _check(lib.dv2_state_save_file(self._h, os.fsencode(path)), "dv2_state_save_file")
        return self.position()

    def load_state(self, path):
        """Makes the state file at `path` (saved from this model by save_state) the request and
        returns the ids at its positions; nothing is pending, so start(prompt) prefills only
        what the prompt adds to them. A file that is not one, or of another model, raises
        StateFileError and leaves the request as it was; one changed or cut short while it is
        read (after those checks), or a device error, leaves the request reset to position 0."""
        return self._loaded(lambda ids, cap, count: lib.dv2_state_load_file(self._h, os.fsencode(path), ids, cap, count),
                            "dv2_state_load_file")

    def state_bytes(self):
        """save_state's file in memory, as a bytearray the library writes where it lies (an 8k
        state of a 3B model is 288 MiB: no copy of it is made), kept (a cache of conversations,
        say) for load_state_bytes; written to a file, load_state reads it."""
        size = self.state_size()
        data = bytearray(size)
        count = ctypes.c_size_t()
        _check(self._save_data((ctypes.c_char * size).from_buffer(data), size, ctypes.byref(count)),
               "dv2_state_save_data")
        return data

    def state_size(self):
        """The bytes state_bytes would return now (a state's size grows with its positions)."""
        return self._size(self._save_data, "dv2_state_save_data")

    def _save_data(self, buf, cap, count):
        return lib.dv2_state_save_data(self._h, buf, cap, count)

    def load_state_bytes(self, data):
        """load_state on a state's bytes (state_bytes, or a state file's contents): bytes, a
        bytearray or any other buffer, read where they lie unless it is read-only and not bytes."""
        if not isinstance(data, bytes):
            view = memoryview(data).cast("B")
            data = bytes(view) if view.readonly else (ctypes.c_char * view.nbytes).from_buffer(view)
        return self._loaded(lambda ids, cap, count: lib.dv2_state_load_data(self._h, data, len(data), ids, cap, count),
                            "dv2_state_load_data")

    def _loaded(self, call, name):
        """Runs a state load, call(ids, cap, count), and takes its ids as the request's."""
        ids = (ctypes.c_int32 * max(self.info.max_seq, 1))()  # a state never holds more
        count = ctypes.c_size_t()
        _check(call(ids, len(ids), ctypes.byref(count)), name)
        self._fed, self._pending = list(ids[: count.value]), None
        return list(self._fed)

    def start(self, ids, reuse=True):
        """Starts a new request with the prompt `ids` and returns the first id it chooses. With
        reuse, the KV cache of the longest prefix the prompt shares with the ids at the last
        request's positions (its prompt and the ids it decoded) is kept, and only the rest of
        the prompt is prefilled: a chat's earlier turns are not computed again. `reused` tells
        how many positions were kept. The kept positions were computed by that request's
        forwards (decode steps, or another prefill's chunks), so on CUDA the logits can differ
        from a fresh prefill's by rounding, and an id chosen at a near-tie with them."""
        keep = _shared(self.held(), ids) if reuse else 0
        self.rewind(keep)
        self.reused = keep
        return self.prefill(ids[keep:])

    def held(self):
        """The ids at the engine's positions, as this object fed them (none where a call it did
        not make moved the engine)."""
        return list(self._fed) if len(self._fed) == self.position() else []

    def prefill(self, ids):
        """Feeds ids from the current position; returns the next id (greedy, or sampled under
        set_sampling)."""
        arr = (ctypes.c_int32 * len(ids))(*_int32(ids, "id"))
        nxt = ctypes.c_int32()
        _check(lib.dv2_prefill(self._h, arr, len(ids), ctypes.byref(nxt)), "dv2_prefill")
        self._fed.extend(ids)
        self._pending = nxt.value
        return nxt.value

    def step(self):
        out = ctypes.c_int32()
        _check(lib.dv2_step(self._h, ctypes.byref(out)), "dv2_step")
        return self._stepped([out.value])[0]

    def step_n(self, n):
        """Up to n ids in one call; fewer when EOS or max_seq stops the request."""
        out = (ctypes.c_int32 * n)()
        count = ctypes.c_size_t()
        _check(lib.dv2_step_n(self._h, n, out, ctypes.byref(count)), "dv2_step_n")
        return self._stepped(list(out[: count.value]))

    def _stepped(self, ids):
        """The mirror after steps that returned `ids`: each fed the pending id and left the
        next one pending."""
        self._fed.append(self._pending)
        self._fed.extend(ids[:-1])
        self._pending = ids[-1]
        return ids

    def step_draft(self, draft):
        """Checks a draft of the host's own (dv2_step_draft: a draft model's ids, say) in one
        forward with the pending id: returns the ids greedy steps give, the draft's accepted
        ids and the one after them (1 to len(draft) + 1)."""
        ids = _int32(list(draft), "draft id")
        arr = (ctypes.c_int32 * max(len(ids), 1))(*ids)
        out = (ctypes.c_int32 * (len(ids) + 1))()
        count = ctypes.c_size_t()
        _check(lib.dv2_step_draft(self._h, arr, len(ids), out, len(ids) + 1, ctypes.byref(count)),
               "dv2_step_draft")
        return self._stepped(list(out[: count.value]))

    def next_token(self):
        out = ctypes.c_int32()
        _check(lib.dv2_next_token(self._h, ctypes.byref(out)), "dv2_next_token")
        return out.value

    def logits(self):
        out = (ctypes.c_float * self.info.vocab)()
        _check(lib.dv2_logits(self._h, out, self.info.vocab), "dv2_logits")
        return list(out)

    def logprobs(self, token_id, n_top=0):
        """Log-probabilities under the last forward's logits (before penalties, temperature and
        truncation): (that of token_id, [(id, logprob)] of the n_top most likely, most likely
        first). Call it right after the prefill or step that returned token_id."""
        lp = ctypes.c_float()
        ids, lps = (ctypes.c_int32 * max(n_top, 1))(), (ctypes.c_float * max(n_top, 1))()
        token_id, = _int32([token_id], "id")
        _check(lib.dv2_logprobs(self._h, token_id, n_top, ctypes.byref(lp), ids, lps), "dv2_logprobs")
        count = min(n_top, self.info.vocab)
        return lp.value, list(zip(ids[:count], lps[:count]))

    def generate(self, prompt, max_tokens=256, chat=False, reuse=True, stop=(), **sampling):
        """Starts a new request and yields its reply as text, piece by piece, as it is decoded.
        `prompt`: text, a list of ids, or with chat=True a list of {"role", "content"} messages
        put through the model's chat template; the prefix it shares with the last request is
        not prefilled again unless reuse is False (start()). Sampling settings as set_sampling
        (none given: those already set; the default is greedy). Stops after max_tokens ids, at
        max_seq, at the model's end of generation (not yielded), or where the text reaches one
        of the `stop` strings (a string or a list of them; the reply ends before it, and the
        text that could still begin one is held back until it cannot). The ids are decoded in
        dv2_step_n batches of about BURST_S seconds (the host out of the token loop, as the
        server decodes), so the engine may have decoded past an end of generation that is not
        its EOS id by the time this returns: the next request rewinds before those ids."""
        if chat:
            ids = self.tokenize(self.chat(prompt), add_special=True, parse_special=True)
        elif isinstance(prompt, (str, bytes)):
            ids = self.tokenize(prompt)
        else:
            ids = list(prompt)
        stops = StopText([stop] if isinstance(stop, str) else stop)
        if sampling:
            self.set_sampling(**sampling)
        stream = TextStream()
        first = self.start(ids, reuse)
        room = self.info.max_seq - len(ids)  # steps the KV cache holds after the prompt
        for next_id in self.decoded(first, min(max_tokens, room + 1)):
            stopped = stops.add(stream.push(self.piece(next_id)))
            text = stops.release(final=stopped)
            if text:
                yield text
            if stopped:
                return
        text = stops.release(final=True)
        if text:
            yield text

    def decoded(self, first, limit, each_step=False):
        """Yields the ids a request decodes: `first` (the id start() or prefill() chose), then
        the ids after it, `limit` at most, ending before the model's end of generation (the
        engine's EOS id, or any id the model file counts as one). Decodes in dv2_step_n
        batches of about BURST_S seconds (the host out of the token loop), or a dv2_step per
        id where each_step (a caller that reads each id's logits before the next step). The
        next step runs only when the caller asks for the next id, so a caller that stops
        early leaves no step run past it but a batch's."""
        next_id, ahead = first, []  # ahead: ids a batch decoded past next_id, not yet yielded
        batch, clock = 1, time.perf_counter()
        for n in range(limit):
            # next_id is the last id decoded when nothing is ahead: finished says it was EOS
            # (a batch stops at EOS, so no id ahead of one is).
            if (not ahead and self.finished()) or self._ends(next_id):
                return
            yield next_id
            if n + 1 == limit:
                return
            if each_step:
                next_id = self.step()
                continue
            if not ahead:
                ahead = self.step_n(min(batch, limit - n - 1))
                batch, clock = next_batch(len(ahead), clock)
            next_id = ahead.pop(0)

    def _ends(self, token_id):
        """Whether token_id ends a generation (the model file's end-of-generation ids; none
        without a tokenizer)."""
        try:
            return self.is_eog(token_id)
        except Dv2Error:
            return False

    def position(self):
        out = ctypes.c_int32()
        _check(lib.dv2_position(self._h, ctypes.byref(out)), "dv2_position")
        return out.value

    def finished(self):
        out = ctypes.c_int32()
        _check(lib.dv2_finished(self._h, ctypes.byref(out)), "dv2_finished")
        return bool(out.value)

    @staticmethod
    def _fetch(call, name, make):
        """Runs call(buffer, cap, count) with no buffer to learn the size
        (DV2_ERR_BUFFER_TOO_SMALL), then with make(size); returns (buffer, count)."""
        n = Engine._size(call, name)
        buf = make(max(n, 1))
        count = ctypes.c_size_t()
        _check(call(buf, n, ctypes.byref(count)), name)
        return buf, count.value

    @staticmethod
    def _size(call, name):
        """The count call(buffer, cap, count) gives with no buffer (DV2_ERR_BUFFER_TOO_SMALL)."""
        count = ctypes.c_size_t()
        status = call(None, 0, ctypes.byref(count))
        if status not in (DV2_OK, DV2_ERR_BUFFER_TOO_SMALL):
            _check(status, name)
        return count.value

    def _bytes(self, call, name):
        """The bytes an entry with the text buffer rule writes."""
        buf, n = self._fetch(call, name, ctypes.create_string_buffer)
        return buf.raw[:n]

    def tokenize(self, text, add_special=True, parse_special=False):
        """The model file's tokenizer: ids of `text` (str or UTF-8 bytes)."""
        data = text.encode() if isinstance(text, str) else bytes(text)
        flags = (DV2_TOKENIZE_ADD_SPECIAL if add_special else 0) | (DV2_TOKENIZE_PARSE_SPECIAL if parse_special else 0)
        call = lambda out, cap, n: lib.dv2_tokenize(self._h, data, len(data), flags, out, cap, n)
        out, n = self._fetch(call, "dv2_tokenize", lambda k: (ctypes.c_int32 * k)())
        return list(out[:n])

    def detokenize(self, ids, skip_special=False):
        """The bytes of `ids` (decode them with .decode("utf-8") for a whole sequence)."""
        arr = (ctypes.c_int32 * max(len(ids), 1))(*_int32(ids, "id"))
        flags = DV2_DETOKENIZE_SKIP_SPECIAL if skip_special else 0
        call = lambda out, cap, n: lib.dv2_detokenize(self._h, arr, len(ids), flags, out, cap, n)
        return self._bytes(call, "dv2_detokenize")

    def chat(self, messages, add_generation_prompt=True):
        """`messages` ([{"role": ..., "content": ...}]) through the model's chat template."""
        arr = (ChatMessage * max(len(messages), 1))(
            *[ChatMessage(m["role"].encode(), m["content"].encode()) for m in messages])
        call = lambda out, cap, n: lib.dv2_chat_apply_template(self._h, arr, len(messages), int(add_generation_prompt),
                                                               out, cap, n)
        return self._bytes(call, "dv2_chat_apply_template").decode()

    def set_sampling(self, **settings):
        """Sampling for this request and the next ones: temperature, top_k, top_p, min_p,
        repeat_penalty, presence_penalty, frequency_penalty, penalty_last_n, seed; the rest
        default (greedy: temperature 0)."""
        s = lib.dv2_sampling_default()
        for name, value in settings.items():
            if name == "struct_size" or name not in dict(Sampling._fields_):
                raise TypeError(f"unknown sampling setting {name!r}")
            setattr(s, name, value)
            if isinstance(value, int) and getattr(s, name) != value:  # ctypes kept its low bits
                raise ValueError(f"sampling setting {name} = {value} is outside its C type's range")
        _check(lib.dv2_set_sampling(self._h, ctypes.byref(s)), "dv2_set_sampling")

    def set_logit_bias(self, bias=None):
        """Adds bias[id] to the logit of each id (a dict; float("-inf") bans it) before the
        penalties and the draw, greedy or sampled, in this request and the next ones; None or
        {} clears it."""
        bias = dict(bias or {})
        ids = (ctypes.c_int32 * max(len(bias), 1))(*_int32(list(bias), "id"))
        values = (ctypes.c_float * max(len(bias), 1))(*bias.values())
        _check(lib.dv2_set_logit_bias(self._h, ids, values, len(bias)), "dv2_set_logit_bias")

    def set_speculation(self, max_draft):
        """Speculative greedy decoding (prompt lookup, dv2_set_speculation): up to max_draft
        ids (0 to 15; 0 turns it off) copied from an earlier occurrence of the request's last
        ids are checked in one forward with the pending id. The ids are greedy decoding's;
        fewer forwards where the reply repeats its context. Plain greedy decoding only (no
        sampling, penalties or logit bias): otherwise every step is a step."""
        max_draft, = _int32([max_draft], "max_draft")
        _check(lib.dv2_set_speculation(self._h, max_draft), "dv2_set_speculation")

    def speculation_stats(self):
        """{"checks", "drafted", "accepted"} since the engine was loaded: forwards over a
        draft, the draft ids fed, and those kept (each a step saved)."""
        out = [ctypes.c_uint64() for _ in range(3)]
        _check(lib.dv2_speculation_stats(self._h, *map(ctypes.byref, out)), "dv2_speculation_stats")
        return dict(zip(("checks", "drafted", "accepted"), (v.value for v in out)))

    def special(self, which):
        """The id of "bos", "eos", "eot" or "pad" as the model file names it, or None."""
        out = ctypes.c_int32()
        kinds = {"bos": 0, "eos": 1, "eot": 2, "pad": 3}
        _check(lib.dv2_token_special(self._h, kinds[which], ctypes.byref(out)), "dv2_token_special")
        return None if out.value < 0 else out.value

    def is_eog(self, token_id):
        out = ctypes.c_int32()
        token_id, = _int32([token_id], "id")
        _check(lib.dv2_token_is_eog(self._h, token_id, ctypes.byref(out)), "dv2_token_is_eog")
        return bool(out.value)

    def meta(self):
        """The model file's metadata as {key: text} (arrays too long for text left out)."""
        count = ctypes.c_size_t()
        _check(lib.dv2_meta_count(self._h, ctypes.byref(count)), "dv2_meta_count")
        out = {}
        for i in range(count.value):
            key = self._bytes(lambda buf, cap, n: lib.dv2_meta_key(self._h, i, buf, cap, n), "dv2_meta_key")
            try:
                value = self._bytes(lambda buf, cap, n: lib.dv2_meta_str(self._h, key, buf, cap, n), "dv2_meta_str")
            except Dv2Error:
                continue  # an array too long to give as text
            out[key.decode()] = value.decode()
        return out

    def piece(self, token_id):
        """The bytes of one id (possibly part of a UTF-8 character)."""
        token_id, = _int32([token_id], "id")
        call = lambda out, cap, n: lib.dv2_token_to_piece(self._h, token_id, out, cap, n)
        return self._bytes(call, "dv2_token_to_piece")


def _shared(held, ids):
    """How many first ids `ids` shares with `held`, leaving at least one of `ids` to prefill."""
    limit, keep = min(len(held), len(ids) - 1), 0
    while keep < limit and held[keep] == ids[keep]:
        keep += 1
    return keep


class StateCache:
    """Earlier requests' states (Engine.state_bytes) in host memory, up to `limit_bytes`, the least
    recently used dropped first, so that conversations taking turns on one engine are not
    prefilled again: Engine.start alone keeps only what the last request left. start() caches
    what the engine holds before a request replaces most of it (keeps less than half, and is
    not wholly inside it), then begins the request from the cached state it shares the most
    ids with, where that is MIN_IDS more than the engine holds."""

    MIN_IDS = 32  # fewer ids prefill faster than a state saves and loads

    def __init__(self, limit_bytes):
        self.limit, self.size = limit_bytes, 0
        self.entries = collections.OrderedDict()  # ids (a tuple) -> the state's bytes

    def start(self, engine, ids):
        """Engine.start(ids), from a cached state where one shares more of `ids`."""
        held = engine.held()
        keep = _shared(held, ids)
        # Not where the request lies wholly inside what the engine holds (another choice or a
        # retry of the same prompt): only the last reply goes then.
        if len(held) >= self.MIN_IDS and keep < len(held) // 2 and keep < len(ids) - 1:
            self._put(tuple(held), engine)
        shared = {key: _shared(key, ids) for key in self.entries}
        best = max(shared, key=shared.get, default=None)
        if best is not None and shared[best] >= keep + self.MIN_IDS:
            self.entries.move_to_end(best)
            engine.load_state_bytes(self.entries[best])
        return engine.start(ids)

    def _put(self, held, engine):
        if any(key[: len(held)] == held for key in self.entries):
            return  # a cached state holds these ids and more: it serves whatever this one would
        if engine.state_size() > self.limit:
            return
        data = engine.state_bytes()
        for key in [key for key in self.entries if held[: len(key)] == key]:
            self.size -= len(self.entries.pop(key))  # states these ids hold and more replace
        while self.size + len(data) > self.limit:
            self.size -= len(self.entries.popitem(last=False)[1])
        self.entries[held] = data
        self.size += len(data)


class StopText:
    """A reply's text as it grows, cut before the first of the stop strings it reaches:
    add(text) appends and says whether a stop string was reached; release() gives the new text
    that can go out, holding back the tail that could still begin a stop string (all of it
    with final=True)."""

    def __init__(self, stops):
        self.stops = list(stops)
        if not all(isinstance(s, str) and s for s in self.stops):
            raise ValueError("stop strings must be non-empty strings")
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0  # characters release() gave

    def add(self, text):
        # A stop string not in the text before can only begin in its last `hold` characters.
        start = max(len(self.text) - self.hold, 0)
        self.text += text
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
        return cut >= 0

    def release(self, final=False):
        upto = len(self.text) if final or not self.stops else len(self.text) - self.hold
        if upto <= self.sent:
            return ""
        new, self.sent = self.text[self.sent:upto], upto
        return new


class TextStream:
    """Joins pieces into text as they arrive: push(piece) returns the new complete UTF-8
    characters, holding back the bytes of a character split across pieces."""

    def __init__(self):
        self._held = b""

    def push(self, piece):
        data = self._held + piece
        # At most the last 3 bytes can be an unfinished character.
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                text = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._held = data[cut:]
            return text
        self._held = b""
        return data.decode("utf-8", errors="replace")  # not UTF-8 at all: shown replaced

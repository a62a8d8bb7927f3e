#!/usr/bin/env python3
"""libubep from Python through ctypes: the C ABI of ubep/ubep_c.h in libubep.so.

The same step as ubep-c-example: attaches a one-rank group (1 layer, 4 experts in 4 slots),
dispatches 4 tokens to 2 experts each, lets expert e scale its rows by e + 1, combines, and
checks every value and the rank's counters; then shows the error a bad expert id gets.
Host backend only: it passes host buffers and reads the received rows on the host (with a CUDA
ubepd both are device memory).

Usage: ubep_ctypes.py LIBUBEP_SO SOCKET
Prints "python ffi ok: 8 rows" and exits 0 on success. Standard library only (no numpy): the
buffers are ctypes arrays; an engine would pass its tensors' data pointers the same way.
"""
import ctypes
import sys

UBEP_DTYPE_FLOAT32 = 0
TOKENS, HIDDEN, TOP_K, EXPERTS = 4, 8, 2, 4


class ModelShape(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_layers", ctypes.c_int32),
        ("num_experts", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("top_k", ctypes.c_int32),
        ("max_tokens", ctypes.c_int32),
        ("slots_per_rank", ctypes.c_int32),
        ("bytes_per_expert", ctypes.c_uint64),
        ("dtype", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


class ClientOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("socket_path", ctypes.c_char_p),
        ("rpc_timeout_ms", ctypes.c_int64),
        ("join_timeout_ms", ctypes.c_int64),
        ("decision_timeout_ms", ctypes.c_int64),
        ("daemon_check_interval_ms", ctypes.c_int64),
    ]


class RankStats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (name, ctypes.c_uint64)
        for name in ("generation", "step", "dispatched_tokens", "dispatch_calls",
                     "combine_calls", "wait_timeouts", "errors", "plan_version")
    ]


class UbepError(Exception):
    def __init__(self, function, code, message):
        super().__init__(f"{function}: code {code}: {message}")
        self.code = code
        self.message = message


def signatures():
    """Every function of ubep/ubep_c.h: name -> (restype, argtypes)."""
    rank_p, dispatched_p = ctypes.c_void_p, ctypes.c_void_p
    i32, i64, u64 = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
    c_int, void_p, POINTER = ctypes.c_int, ctypes.c_void_p, ctypes.POINTER
    return {
        "ubep_last_error": (ctypes.c_char_p, []),
        "ubep_client_options_init": (None, [POINTER(ClientOptions), ctypes.c_size_t]),
        "ubep_attach": (c_int, [ctypes.c_char_p, i32, i32, i32, POINTER(ModelShape),
                                POINTER(rank_p)]),
        "ubep_attach_at": (c_int, [ctypes.c_char_p, i32, i32, i32, POINTER(ModelShape), i64,
                                   POINTER(rank_p)]),
        "ubep_attach_with": (c_int, [POINTER(ClientOptions), i32, i32, i32, POINTER(ModelShape),
                                     i64, POINTER(rank_p)]),
        "ubep_detach": (c_int, [rank_p]),
        "ubep_resume_step": (u64, [rank_p]),
        "ubep_begin_step": (c_int, [rank_p, u64]),
        "ubep_rejoin": (c_int, [rank_p, i64, POINTER(u64)]),
        "ubep_excluded": (c_int, [rank_p]),
        "ubep_must_attach_again": (c_int, [rank_p]),
        "ubep_stats": (c_int, [rank_p, POINTER(RankStats)]),
        "ubep_dispatched_new": (dispatched_p, []),
        "ubep_dispatched_free": (None, [dispatched_p]),
        "ubep_dispatch": (c_int, [rank_p, i32, void_p, POINTER(i32), POINTER(ctypes.c_float), i32,
                                  dispatched_p]),
        "ubep_dispatched_view": (None, [dispatched_p, POINTER(i32), POINTER(void_p),
                                        POINTER(POINTER(i32)), POINTER(POINTER(i32)),
                                        POINTER(POINTER(i32)), POINTER(POINTER(ctypes.c_float))]),
        "ubep_dispatched_plan": (c_int, [dispatched_p, POINTER(u64), POINTER(i32)]),
        "ubep_combine": (c_int, [rank_p, dispatched_p, void_p, void_p]),
        "ubep_expert_weights": (c_int, [rank_p, i32, i32, POINTER(void_p), POINTER(u64)]),
        "ubep_slot_expert": (c_int, [rank_p, i32, i32, POINTER(i32)]),
        "ubep_weights_loaded": (c_int, [rank_p]),
    }


def load(path):
    """Opens libubep.so and declares every function of its C ABI."""
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in signatures().items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def check(lib, function, code):
    if code != 0:
        raise UbepError(function, code, lib.ubep_last_error().decode(errors="replace"))


def main(argv):
    if len(argv) != 3:
        print("usage: ubep_ctypes.py LIBUBEP_SO SOCKET", file=sys.stderr)
        return 2
    lib = load(argv[1])
    options = ClientOptions()
    lib.ubep_client_options_init(ctypes.byref(options), ctypes.sizeof(options))
    options.socket_path = argv[2].encode()
    options.join_timeout_ms = 30000
    shape = ModelShape(ctypes.sizeof(ModelShape), 1, EXPERTS, HIDDEN, TOP_K, TOKENS, EXPERTS, 0,
                       UBEP_DTYPE_FLOAT32)
    rank = ctypes.c_void_p()
    check(lib, "attach", lib.ubep_attach_with(ctypes.byref(options), 0, 1, 0,
                                             ctypes.byref(shape), -1, ctypes.byref(rank)))
    try:
        check(lib, "begin_step", lib.ubep_begin_step(rank, lib.ubep_resume_step(rank)))
        x = (ctypes.c_float * (TOKENS * HIDDEN))(*[float(i) for i in range(TOKENS * HIDDEN)])
        idx = (ctypes.c_int32 * (TOKENS * TOP_K))()
        w = (ctypes.c_float * (TOKENS * TOP_K))()
        for t in range(TOKENS):
            idx[t * TOP_K], idx[t * TOP_K + 1] = t % EXPERTS, (t + 1) % EXPERTS
            w[t * TOP_K], w[t * TOP_K + 1] = 0.25, 0.75
        d = lib.ubep_dispatched_new()
        if not d:
            raise UbepError("dispatched_new", 8, lib.ubep_last_error().decode(errors="replace"))
        try:
            check(lib, "dispatch", lib.ubep_dispatch(rank, 0, x, idx, w, TOKENS, d))
            rows = ctypes.c_int32()
            recv = ctypes.c_void_p()
            offsets = ctypes.POINTER(ctypes.c_int32)()
            lib.ubep_dispatched_view(d, ctypes.byref(rows), ctypes.byref(recv),
                                     ctypes.byref(offsets), None, None, None)
            received = ctypes.cast(recv, ctypes.POINTER(ctypes.c_float))
            # The experts: expert e, in whichever slot the step's plan puts it, scales its rows
            # by e + 1.
            y = (ctypes.c_float * (rows.value * HIDDEN))()
            for slot in range(EXPERTS):
                expert = ctypes.c_int32()
                check(lib, "slot_expert", lib.ubep_slot_expert(rank, 0, slot, ctypes.byref(expert)))
                for r in range(offsets[slot], offsets[slot + 1]):
                    for h in range(HIDDEN):
                        y[r * HIDDEN + h] = (expert.value + 1) * received[r * HIDDEN + h]
            out = (ctypes.c_float * (TOKENS * HIDDEN))()
            check(lib, "combine", lib.ubep_combine(rank, d, y, out))
            for t in range(TOKENS):
                for h in range(HIDDEN):
                    e0, e1 = idx[t * TOP_K], idx[t * TOP_K + 1]
                    want = 0.25 * (e0 + 1) * x[t * HIDDEN + h] + 0.75 * (e1 + 1) * x[t * HIDDEN + h]
                    got = out[t * HIDDEN + h]
                    if abs(got - want) > 1e-6 * max(1.0, abs(want)):
                        print(f"out[{t}][{h}] = {got}, want {want}", file=sys.stderr)
                        return 1
            stats = RankStats(struct_size=ctypes.sizeof(RankStats))
            check(lib, "stats", lib.ubep_stats(rank, ctypes.byref(stats)))
            counted = (stats.dispatch_calls, stats.combine_calls, stats.dispatched_tokens)
            if counted != (1, 1, TOKENS):
                print(f"stats: {stats.dispatch_calls} dispatches, {stats.combine_calls} combines, "
                      f"{stats.dispatched_tokens} tokens", file=sys.stderr)
                return 1
            idx[2 * TOP_K + 1] = 7
            try:
                check(lib, "dispatch", lib.ubep_dispatch(rank, 0, x, idx, w, TOKENS, d))
                print("a bad expert id was accepted", file=sys.stderr)
                return 1
            except UbepError as e:
                print(f"bad expert: code {e.code}: {e.message}")
                if e.code != 3:  # INVALID_ARGUMENT, before any byte moved; nothing else.
                    return 1
            print(f"python ffi ok: {rows.value} rows")
        finally:
            lib.ubep_dispatched_free(d)
    finally:
        # Detached whatever happened; its error is raised only when nothing else was.
        detached = lib.ubep_detach(rank)
    check(lib, "detach", detached)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

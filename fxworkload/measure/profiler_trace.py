"""A PyTorch profiler trace, tied to the rows of an extracted workload: measured time per graph node.

The trace is read by HolisticTraceAnalysis (HTA), the profiler's own analysis library: it loads
``.json`` and ``.json.gz`` Kineto traces, ties every GPU kernel to the runtime call that launched
it (the ``correlation`` id), nests CPU ops into call stacks per thread, and numbers ProfilerStep
iterations. On that structure:

- **Forward.** The ops of a step before its backward starts, taken at the level make_fx records
  (the innermost ops carrying an autograd sequence number: ``aten::linear`` gives ``t`` and
  ``addmm``, ``aten::dropout`` gives ``empty_like``, ``bernoulli_``, ``div_``, ``mul``), are aligned
  with the workload's forward rows by op name and order (difflib's longest matching blocks). An
  op left unmatched between two matches is opened into the ops it called and aligned again with
  the graph ops between the same two.
- **Backward.** Every ``autograd::engine::evaluate_function: XBackward0`` carries the sequence
  number of the forward op that created its autograd node; that op's row owns it, as the capture
  assigns the graph's backward ops (trace.py). The ops it ran are aligned with that row's input-
  and weight-gradient ops the same way.
- **Time.** On a GPU trace, kernel time; on a CPU trace, op time (each op's self time, so nothing
  counts twice). A unit of time belongs to the deepest matched op above it; failing that, to the
  row whose backward or composite op it ran in (that row's time, no op of its own); failing that,
  it is unattributed and reported by its top-level op's name. ``nccl`` kernels and ``c10d`` ops
  are communication.

A trace holding several ProfilerStep iterations gives each op its median over the steps.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import statistics
import tempfile
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..capture.trace import FORWARD, INPUT_GRAD, PHASES, WEIGHT_GRAD
from ..errors import UserError
from ..inputs import finite_number, load_json, read_input, whole_number

BACKWARD_ROOT = "autograd::engine::evaluate_function: "
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
COMMUNICATION_MARKS = ("nccl", "c10d::", "record_param_comms")
MAX_OPENINGS = 16  # levels of composite ops opened while aligning
# Matched ops whose input shapes differ on both sides, beyond which the trace is of another step.
MAX_SHAPE_MISMATCH = 0.1


@dataclass
class Event:
    index: int
    name: str
    category: str
    ts: float
    dur_ns: float
    tid: int
    sequence: int
    step: int
    shapes: list | None
    parent: "Event | None" = None
    children: list["Event"] = field(default_factory=list)


@dataclass
class TraceAttribution:
    """Measured ns per (row, phase): per op position and the row's rest; what could not be tied."""
    op_ns: dict[tuple[int, str, int], float]  # (row index, phase, op index within the phase) -> ns
    rest_ns: dict[tuple[int, str], float]  # time of a row's phase tied to no op of its own
    unattributed_ns: dict[str, float]  # top-level op name -> ns
    communication_ns: float
    total_ns: float  # the trace's own op time (CPU) or kernel time (GPU), over the steps read
    unit: str  # "kernel" or "cpu op"
    steps: int
    device: str
    unmarked_steps: int = 0  # training steps found in a trace without ProfilerStep markers (read as one)
    # dropout as the loop ran it, per step: calls to aten::dropout, and the kernels a training-mode dropout runs
    # (native_dropout, or bernoulli_ on the CPU); calls without kernels: the model was in eval mode
    dropout_calls: float = 0.0
    dropout_kernels: float = 0.0

    @property
    def attributed_ns(self) -> float:
        return self.total_ns - sum(self.unattributed_ns.values()) - self.communication_ns

    @property
    def attributed_fraction(self) -> float:
        return self.attributed_ns / self.total_ns if self.total_ns else 0.0


def read_events(path: Path) -> tuple[list[Event], str]:
    """Every CPU op, annotation and kernel of the trace, nested; and the device it ran on."""
    frame, device = _hta_frame(path)
    events: dict[int, Event] = {}
    rows = frame[["index", "s_name", "s_cat", "ts", "dur", "tid", "sequence", "iteration", "parent",
                  "input_dims", "input_type"]].itertuples(index=False)
    parents = {}
    for index, name, category, ts, dur, tid, sequence, step, parent, dims, types in rows:
        if category not in CPU_CATEGORIES and category not in GPU_CATEGORIES:
            continue
        events[index] = Event(index=index, name=name, category=category, ts=float(ts), dur_ns=max(float(dur), 0) * 1e3,
                              tid=int(tid), sequence=int(sequence), step=int(step), shapes=_tensor_shapes(dims, types))
        parents[index] = int(parent) if parent == parent else -1  # NaN: no parent
    for index, event in events.items():
        parent = events.get(parents[index])
        if parent is None:
            continue
        event.parent = parent
        parent.children.append(event)
    for event in events.values():
        event.children.sort(key=lambda e: (e.ts, -e.dur_ns))
    return sorted(events.values(), key=lambda e: (e.ts, -e.dur_ns)), device


@contextlib.contextmanager
def _quiet_hta():
    """HTA logs each parse at INFO and rounds times to whole microseconds unless told not to:
    keep its logs out of our output and the trace's nanoseconds (a GPU kernel is a few µs)."""
    previous = os.environ.get("HTA_DISABLE_NS_ROUNDING")
    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    loggers = [logging.getLogger(name) for name in ("hta", "")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():  # HTA's pandas calls warn of deprecations on every parse
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if previous is None:
            os.environ.pop("HTA_DISABLE_NS_ROUNDING", None)
        else:
            os.environ["HTA_DISABLE_NS_ROUNDING"] = previous


HTA_MISSING = "reading a profiler trace needs HolisticTraceAnalysis: pip install 'fxworkload[traces]' (make run installs it)"


def check_trace_reader() -> None:
    """Before minutes of work that end in reading a trace: HolisticTraceAnalysis is installed."""
    import importlib.util

    if importlib.util.find_spec("hta") is None:
        raise UserError(HTA_MISSING)


def _hta_frame(path: Path):
    try:
        with _quiet_hta():
            from hta.common.call_stack import CallGraph
            from hta.common.trace import Trace
            from hta.configs.parser_config import ParserConfig
    except ImportError:
        raise UserError(HTA_MISSING) from None
    config = ParserConfig.get_default_cfg().clone()
    available = ParserConfig.get_all_available_args()
    config.add_args([available[key] for key in ("cpu_op::sequence_number", "cpu_op::fwd_thread")])
    _check_readable(path)
    with contextlib.ExitStack() as stack:
        readable = _regular_file(path, stack)
        return _parse(path, readable, config, Trace, CallGraph)


def _regular_file(path: Path, stack: contextlib.ExitStack) -> Path:
    """HTA reads the trace from a path: a pipe, already read once, is handed over as a temporary copy."""
    if path.is_file():
        return path.resolve()
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fxworkload-trace-")))
    copy = folder / "trace.json"
    copy.write_bytes(read_input(path, WHAT))
    return copy


def _parse(path: Path, readable: Path, config, Trace, CallGraph):
    try:
        with _quiet_hta(), open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            trace = Trace(trace_files={0: str(readable)}, trace_dir=str(readable.parent),
                          parser_config=config)
            trace.parse_traces(use_multiprocessing=False)
            trace.decode_symbol_ids(use_shorten_name=False)
            frame = trace.get_trace(0)
            if frame.empty or "s_cat" not in frame:
                raise ValueError("no events")
            CallGraph(trace, ranks=[0])
            frame = trace.get_trace(0)
            properties = trace.meta_data.get(0, {}).get("deviceProperties") or []
    except UserError:
        raise
    except Exception as exc:  # HTA raises what pandas and json raise on a malformed trace
        raise UserError(f"{path}: cannot read it as a PyTorch profiler trace ({type(exc).__name__}: "
                        f"{str(exc)[:120]}); pass the JSON that torch.profiler's export_chrome_trace wrote") from None
    for column, default in (("sequence", -1), ("iteration", -1), ("parent", -1), ("input_dims", None),
                            ("input_type", None)):
        if column not in frame:
            frame[column] = default
    names = sorted({p.get("name") for p in properties if isinstance(p, dict) and p.get("name")})
    return frame, ", ".join(names) or "CPU"


WHAT = "the JSON trace torch.profiler's export_chrome_trace wrote (.json or .json.gz)"
MAX_EVENT_US = 86_400e6  # one day: no op or kernel of a training step runs longer
MAX_TS_US = 1e17  # Kineto's timestamps are µs since an epoch (~1.7e15 now)


def _check_readable(path: Path) -> dict:
    """The trace's JSON, every field we and HTA read checked, before HTA sees it: one line naming the
    file, the event and the field otherwise."""
    document = load_json(path, WHAT)
    events = document.get("traceEvents") if isinstance(document, dict) else None
    if not isinstance(events, list) or not any(isinstance(e, dict) and e.get("cat") == "cpu_op" for e in events):
        raise UserError(f"{path}: a JSON file with no profiler ops ('traceEvents' with cpu_op events); "
                        "profile with torch.profiler and export_chrome_trace")
    for number, event in enumerate(events):
        problem = _event_problem(event)
        if problem:
            name = event.get("name") if isinstance(event, dict) and isinstance(event.get("name"), str) else "?"
            raise UserError(f"{path}: traceEvents[{number}] ({name[:60]!r}): {problem}; pass {WHAT}, unedited")
    return document


def _event_problem(event) -> str | None:
    """The first field of an op or kernel event that is missing or not what Kineto writes."""
    if not isinstance(event, dict):
        return "not an object"
    if event.get("cat") not in CPU_CATEGORIES + GPU_CATEGORIES:
        return None  # metadata, flows, counters: not read
    if not isinstance(event.get("name"), str):
        return f"'name' is {event.get('name')!r}, not an op name"
    for key, high in (("ts", MAX_TS_US), ("dur", MAX_EVENT_US)):
        if not finite_number(event.get(key), -MAX_TS_US if key == "ts" else 0.0, high):
            return f"'{key}' is {event.get(key)!r}, not a time in µs ({'0 to ' if key == 'dur' else ''}{high:.3g})"
    for key in ("pid", "tid"):
        value = event.get(key)
        if not whole_number(value, -(1 << 62)) and not (isinstance(value, str) and value.lstrip("-").isdigit()):
            return f"'{key}' is {value!r}, not an integer id"
    args = event.get("args", {})
    if not isinstance(args, dict):
        return "'args' is not an object"
    for key in ("Sequence number", "External id", "correlation", "Fwd thread id"):
        if key in args and not whole_number(args[key], -(1 << 62)):
            return f"args '{key}' is {args[key]!r}, not an integer"
    return None


def _tensor_shapes(dims, types) -> list | None:
    """The shapes of the tensor arguments, as the workload lists them (scalars and lists left out)."""
    if not isinstance(dims, list) or not isinstance(types, list) or len(dims) != len(types):
        return None
    return [list(d) for d, t in zip(dims, types) if t and t not in ("Scalar", "ScalarList", "TensorList", "GenericList")
            and isinstance(d, list)]


# Graph ops recorded under another name than the op eager runs: transformers' MoE fallback stands in
# for torch._grouped_mm in the capture (its meta function refuses fp32), with the same shapes; make_fx
# records the view that eager reshape makes through _reshape_alias.
SAME_OP = {"grouped_mm_fallback": "_grouped_mm", "_reshape_alias": "view"}


def short_name(op: str) -> str:
    """``aten::addmm`` and ``aten.addmm.default`` are both ``addmm``."""
    if "::" in op:
        name = op.split("::", 1)[1]
    elif op.startswith(("aten.", "transformers.")):
        name = op.split(".")[1]
    else:
        name = op
    return SAME_OP.get(name, name)


@dataclass(frozen=True)
class GraphOp:
    row: int
    phase: str
    position: int
    name: str
    shapes: list


def graph_ops(rows: list[dict]) -> tuple[list[GraphOp], dict[int, list[GraphOp]]]:
    """The workload's forward ops in order, and each row's backward ops (input-grad, then weight-grad)."""
    forward, backward = [], {}
    for index, row in enumerate(rows):
        op = row.get("forward")
        if isinstance(op, dict) and op.get("op") != "getitem":
            forward.append(GraphOp(index, FORWARD, 0, short_name(op["op"]), op.get("input_shapes")))
        backward[index] = [GraphOp(index, phase, position, short_name(o["op"]), o.get("input_shapes"))
                           for phase in (INPUT_GRAD, WEIGHT_GRAD) for position, o in enumerate(row.get(phase) or [])
                           if o.get("op") != "getitem"]
    return forward, backward


def align(events: list[Event], ops: list[GraphOp], depth: int = 0) -> dict[int, GraphOp]:
    """Event index -> the graph op it ran. Matches are kept; the unmatched events between two
    matches are opened into the ops they called and aligned with the graph ops between the same two."""
    matched: dict[int, GraphOp] = {}
    pairs = common_subsequence([short_name(e.name) for e in events], [o.name for o in ops])
    event_at = op_at = 0
    for a, b in [*pairs, (len(events), len(ops))]:
        gap_ops = ops[op_at:b]
        opened = [child for event in events[event_at:a] for child in _cpu_children(event)]
        if opened and gap_ops and depth < MAX_OPENINGS:
            matched.update(align(opened, gap_ops, depth + 1))
        if a < len(events):
            matched[events[a].index] = ops[b]
        event_at, op_at = a + 1, b + 1
    return matched


# autograd's MmBackward0 runs the weight's gradient GEMM before the input's (Functions.cpp), where the graph lists
# the input's first: matched in order, the two cross (lm_head's weight-gradient GEMM, the costliest, went
# unpaired). Where the trace recorded shapes, a backward's GEMMs are paired with the row's GEMMs of exactly their
# operand shapes, whatever the order; GEMMs whose shapes the run decided (an MoE expert's tokens) match none
# and keep their order.
SHAPED_MATCH = frozenset({"mm", "bmm", "addmm", "baddbmm"})


def _gemms_by_shape(root: "Event", ops: list[GraphOp], found: dict[int, GraphOp]) -> None:
    """Re-pair, in ``found``, the root's GEMM events with the row's GEMM ops of the same name and shapes."""
    waiting = [op for op in ops if op.name in SHAPED_MATCH and op.shapes is not None]
    exact: dict[int, GraphOp] = {}
    stack = list(root.children)
    while stack and waiting:
        event = stack.pop(0)
        stack[:0] = _cpu_children(event)
        if short_name(event.name) not in SHAPED_MATCH or event.shapes is None:
            continue
        same = next((op for op in waiting if op.name == short_name(event.name) and op.shapes == event.shapes), None)
        if same is not None:
            exact[event.index] = same
            waiting.remove(same)
    if not exact:
        return
    taken = {id(op) for op in exact.values()}
    for index in [i for i, op in found.items() if id(op) in taken and i not in exact]:
        del found[index]  # its op now goes to the event of its own shapes
    found.update(exact)


# Above this many cells the longest common subsequence table would not fit in memory: difflib's
# longest matching blocks stand in (a decoder stack repeats, so blocks can pair layer k with k + 1).
MAX_LCS_CELLS = 40_000_000


def common_subsequence(a: list[str], b: list[str]) -> list[tuple[int, int]]:
    """Index pairs of a longest common subsequence of two name lists, in order.

    Row by row with numpy: L[i][j] = max(L[i-1][j], L[i-1][j-1] + 1 where a[i] == b[j]), then a
    running maximum along j gives L[i][j-1]'s term."""
    if not a or not b:
        return []
    if len(a) * len(b) > MAX_LCS_CELLS:
        blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
        return [(x.a + k, x.b + k) for x in blocks for k in range(x.size)]
    codes: dict[str, int] = {}
    a_codes = np.array([codes.setdefault(x, len(codes)) for x in a])
    b_codes = np.array([codes.setdefault(x, len(codes)) for x in b])
    dtype = np.uint16 if min(len(a), len(b)) < 65535 else np.uint32
    table = np.zeros((len(a) + 1, len(b) + 1), dtype=dtype)
    for i in range(1, len(a) + 1):
        previous = table[i - 1]
        diagonal = np.where(b_codes == a_codes[i - 1], previous[:-1] + 1, 0).astype(dtype)
        table[i, 1:] = np.maximum.accumulate(np.maximum(previous[1:], diagonal))
    pairs, i, j = [], len(a), len(b)
    while i and j:
        if a_codes[i - 1] == b_codes[j - 1] and table[i, j] == table[i - 1, j - 1] + 1:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif table[i - 1, j] >= table[i, j - 1]:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


def autograd_level(event: Event) -> list[Event]:
    """The ops that make_fx records below ``event``: the innermost ones that carry a sequence
    number (every op dispatched through autograd does; the kernels' helpers below it do not).
    An op with none below it stands for itself."""
    below = [leaf for child in _cpu_children(event) if _numbered(child) for leaf in autograd_level(child)]
    return below or [event]


def _numbered(event: Event) -> bool:
    return event.sequence >= 0 or any(_numbered(child) for child in _cpu_children(event))


def _cpu_children(event: Event) -> list[Event]:
    return [c for c in event.children if c.category == "cpu_op"]


def attribute(path: Path, rows: list[dict]) -> TraceAttribution:
    events, device = read_events(path)
    forward_ops, backward_ops = graph_ops(rows)
    gpu = any(e.category in GPU_CATEGORIES for e in events)
    roots = [e for e in events if e.category == "cpu_op" and not _has_cpu_op_above(e)]
    steps = sorted({e.step for e in roots})
    if len(steps) > 1:  # ProfilerStep iterations: what ran outside them is no step's
        steps = [s for s in steps if s >= 0]
    unmarked = unmarked_steps(roots) if steps == [-1] else 0
    orphans = [e for e in events if e.category in GPU_CATEGORIES and e.parent is None]
    by_index = {e.index: e for e in events}
    per_step = []
    for step in steps:
        found = _attribute_step([r for r in roots if r.step == step], forward_ops, backward_ops, gpu, by_index)
        if found is not None:
            lost_ns = sum(e.dur_ns for e in orphans if e.step == step)
            if lost_ns:
                found.unattributed_ns["(kernels no op launched)"] += lost_ns
                found.total_ns += lost_ns
            per_step.append(found)
    if not per_step:
        raise UserError(f"{path}: no training step of this model found in the trace: none of its ops lines up with "
                        "the workload's forward ops; profile a step of the model the workload was extracted from")
    unattributed: dict[str, float] = defaultdict(float)
    for s in per_step:
        for name, ns in s.unattributed_ns.items():
            unattributed[name] += ns / len(per_step)
    return TraceAttribution(
        op_ns=_median_over_steps([s.op_ns for s in per_step]), rest_ns=_median_over_steps([s.rest_ns for s in per_step]),
        unattributed_ns=dict(unattributed), communication_ns=statistics.fmean(s.communication_ns for s in per_step),
        total_ns=statistics.fmean(s.total_ns for s in per_step), unit="kernel" if gpu else "cpu op",
        steps=len(per_step), device=device, unmarked_steps=unmarked,
        dropout_calls=_per_step(events, DROPOUT_CALLS, len(per_step)),
        dropout_kernels=_per_step(events, DROPOUT_KERNELS, len(per_step)))


DROPOUT_CALLS = ("aten::dropout", "aten::feature_dropout")
DROPOUT_KERNELS = ("aten::native_dropout", "aten::bernoulli_")


def _per_step(events: list[Event], names: tuple[str, ...], steps: int) -> float:
    """How many of these ops the trace's profiled steps ran, per step (a warm-up outside ProfilerStep left out)."""
    count = sum(1 for e in events if e.category == "cpu_op" and e.name in names and (e.step >= 0 or steps == 1))
    return count / max(steps, 1)


@dataclass
class _StepTimes:
    op_ns: dict  # (row, phase, position) -> ns
    rest_ns: dict  # (row, phase) -> ns tied to the row but to no op of its own
    unattributed_ns: dict  # top-level op name -> ns
    communication_ns: float = 0.0
    total_ns: float = 0.0


def _has_cpu_op_above(event: Event) -> bool:
    parent = event.parent
    while parent is not None:
        if parent.category == "cpu_op":
            return True
        parent = parent.parent
    return False


def _median_over_steps(dicts: list[dict]) -> dict:
    keys = set().union(*dicts)
    return {key: statistics.median(d[key] for d in dicts if key in d) for key in keys}


def _attribute_step(roots: list[Event], forward_ops: list[GraphOp], backward_ops: dict[int, list[GraphOp]],
                    gpu: bool, by_index: dict[int, Event]) -> _StepTimes | None:
    roots.sort(key=lambda e: e.ts)
    backward_roots = [r for r in roots if r.name.startswith(BACKWARD_ROOT)]
    backward_start = min((r.ts for r in backward_roots), default=float("inf"))
    forward_roots = [r for r in roots if not r.name.startswith(BACKWARD_ROOT) and r.ts < backward_start
                     and not _is_communication(r)]
    matched = align([leaf for root in forward_roots for leaf in autograd_level(root)], forward_ops)
    if not matched:
        return None
    _check_shapes(matched, by_index)
    creator_row = _creators(roots, matched)
    accumulated_by: dict[int, int] = {}  # AccumulateGrad root -> the row whose backward made the gradient
    last_row = None
    for root in backward_roots:
        row = creator_row.get(root.sequence)
        if row is not None and backward_ops[row]:
            found = align(root.children, backward_ops[row])
            _gemms_by_shape(root, backward_ops[row], found)
            matched.update(found)
        if root.name.endswith("AccumulateGrad") and last_row is not None:
            accumulated_by[root.index] = last_row
        last_row = row if row is not None else last_row
    owner: dict[int, tuple] = {}
    for root in roots:
        here = ("rest", (accumulated_by[root.index], WEIGHT_GRAD)) if root.index in accumulated_by else None
        _assign(root, here, matched, creator_row, owner)
    times = _StepTimes(defaultdict(float), defaultdict(float), defaultdict(float))
    for root in roots:
        for event, ns in _time_units(root, gpu):
            times.total_ns += ns
            where = owner.get(event.index)
            if _is_communication(root) or _is_communication(event):
                times.communication_ns += ns
            elif where is None:
                times.unattributed_ns[_unattributed_name(root)] += ns
            elif where[0] == "op":
                times.op_ns[where[1]] += ns
            else:
                times.rest_ns[where[1]] += ns
    _split_backward_rest(times.op_ns, times.rest_ns)
    return times


OPTIMIZER_MARK = "Optimizer.step#"  # torch.optim wraps each step in record_function("Optimizer.step#<Class>.step")


def _unattributed_name(root: Event) -> str:
    """A top-level op tied to no node, by name; the optimizer's ops (inside its record_function) as its step."""
    above = root.parent
    while above is not None:
        if above.name.startswith(OPTIMIZER_MARK):
            return f"optimizer step ({above.name.removeprefix(OPTIMIZER_MARK)})"
        above = above.parent
    return root.name


def unmarked_steps(roots: list[Event]) -> int:
    """How many training steps the top-level ops hold, counted as forward-to-backward turns of the
    main thread: a trace of several steps without ProfilerStep markers is otherwise read as one."""
    threads = defaultdict(list)
    for root in roots:
        threads[root.tid].append(root)
    main = max(threads.values(), key=len, default=[])
    turns, previous_backward = 0, True
    for root in sorted(main, key=lambda e: e.ts):
        backward = root.name.startswith(BACKWARD_ROOT)
        if backward and not previous_backward:
            turns += 1
        previous_backward = backward
    return turns


def _split_backward_rest(op_ns: dict, rest_ns: dict) -> None:
    """A row's backward time tied to no op goes to its two gradient phases in proportion to their ops."""
    for (row, phase) in [k for k in rest_ns if k[1] == "backward"]:
        ns = rest_ns.pop((row, phase))
        by_phase = {p: sum(v for (r, ph, _), v in op_ns.items() if r == row and ph == p) for p in (INPUT_GRAD, WEIGHT_GRAD)}
        total = sum(by_phase.values())
        for p in (INPUT_GRAD, WEIGHT_GRAD):
            share = by_phase[p] / total if total else (1.0 if p == INPUT_GRAD else 0.0)
            if share:
                rest_ns[(row, p)] = rest_ns.get((row, p), 0.0) + ns * share


def _check_shapes(matched: dict[int, GraphOp], by_index: dict[int, Event]) -> None:
    compared = differ = 0
    example = None
    for index, op in matched.items():
        shapes = by_index[index].shapes
        if shapes is None or op.shapes is None or len(shapes) != len(op.shapes):
            continue
        compared += 1
        if shapes != op.shapes:
            differ += 1
            example = example or (op.name, op.shapes, shapes)
    if compared and differ > MAX_SHAPE_MISMATCH * compared:
        name, ours, theirs = example
        raise UserError(f"the trace is of another step: {differ} of {compared} ops read other shapes than the workload's "
                        f"(e.g. {name} {ours} in the workload, {theirs} in the trace); extract with the model, --batch, "
                        "--seq and --dtype the profiled step used")


def _creators(roots: list[Event], matched: dict[int, GraphOp]) -> dict[int, int]:
    """Sequence number -> the row of the forward op that created that autograd node: the last matched
    op recorded under the number (ops that create no node record the number the next one will get)."""
    creator: dict[int, int] = {}
    for root in roots:
        if root.name.startswith(BACKWARD_ROOT):
            continue
        stack = [root]
        while stack:
            event = stack.pop()
            op = matched.get(event.index)
            if op is not None and event.sequence >= 0:
                previous = creator.get(event.sequence)
                if previous is None or previous[0] <= event.ts:
                    creator[event.sequence] = (event.ts, op.row)
            stack += event.children
    return {sequence: row for sequence, (_, row) in creator.items()}


def _assign(event: Event, inherited, matched, creator_row, owner) -> None:
    """owner[event] = ("op", (row, phase, position)) or ("rest", (row, phase)); inherited by what it ran."""
    op = matched.get(event.index)
    if op is not None:
        here = ("op", (op.row, op.phase, op.position))
    elif event.name.startswith(BACKWARD_ROOT) and event.sequence in creator_row:
        here = ("rest", (creator_row[event.sequence], "backward"))
    elif inherited is None and event.category == "cpu_op":
        last = _last_matched_below(event, matched)
        here = None if last is None else ("rest", (last.row, last.phase if last.phase == FORWARD else "backward"))
    else:
        here = inherited
    if here is not None:
        owner[event.index] = here
    for child in event.children:
        _assign(child, here, matched, creator_row, owner)


def _last_matched_below(event: Event, matched: dict[int, GraphOp]) -> GraphOp | None:
    last = None
    for child in event.children:
        below = matched.get(child.index) or _last_matched_below(child, matched)
        last = below or last
    return last


def _time_units(root: Event, gpu: bool):
    """(event, ns): every kernel's time on a GPU trace, every CPU op's self time on a CPU trace."""
    stack = [root]
    while stack:
        event = stack.pop()
        stack += event.children
        if gpu:
            if event.category in GPU_CATEGORIES:
                yield event, event.dur_ns
        elif event.category == "cpu_op":
            inner = sum(c.dur_ns for c in event.children if c.category == "cpu_op")
            yield event, max(event.dur_ns - inner, 0.0)


def _is_communication(event: Event) -> bool:
    return any(mark in event.name for mark in COMMUNICATION_MARKS)


def measured_document(path: Path, estimated: dict) -> dict:
    """The trace as a measured.json of the estimated workload's rows: the same rows and ops, with the
    time the trace spent in each; an op the trace did not run is left out (unpaired)."""
    rows = [r for r in estimated["rows"] if r.get("type") == "node"]
    found = attribute(path, rows)
    measured_rows = []
    for index, row in enumerate(rows):
        out = {"type": "node", "name": row["name"]}
        for phase in PHASES:
            ops = [row[phase]] if phase == FORWARD else row[phase] or []
            timed = [dict(op, measured_ns=found.op_ns[(index, phase, position)])
                     for position, op in enumerate(ops) if (index, phase, position) in found.op_ns]
            out[phase] = (timed[0] if timed else None) if phase == FORWARD else timed
            out[f"{phase}_measured_ns"] = (sum(op["measured_ns"] for op in timed)
                                           + found.rest_ns.get((index, phase), 0.0))
        measured_rows.append(out)
    settings = dict(estimated.get("settings", {}), model=path.name, device=found.device,
                    timer=f"torch.profiler ({found.unit} time)")
    trace = {"path": str(path), "unit": found.unit, "steps": found.steps, "total_ns": found.total_ns,
             "attributed_ns": found.attributed_ns, "attributed_fraction": found.attributed_fraction,
             "communication_ns": found.communication_ns, "unmarked_steps": found.unmarked_steps,
             "device": found.device, "dropout_calls": found.dropout_calls, "dropout_kernels": found.dropout_kernels,
             "unattributed_ns": dict(sorted(found.unattributed_ns.items(), key=lambda kv: -kv[1]))}
    return {"settings": settings, "rows": measured_rows, "totals": {}, "trace": trace, "path": str(path)}

"""Which specializations `kdsl aot` compiles, and the routing the C dispatcher is generated from.

Which kernel serves an op on an arch is the registry's choice (kdsl.runtime.registry), with the kernels this
exporter cannot export left out (each reported with its reason, abi.OpAbi.unexportable): their cases go to
the kernel the registry would pick next. Per tile bucket, the specializations compiled are those the op's
representative calls produce (abi.OpAbi.problems: Triton's rules, integer arguments equal to 1 or divisible
by 16 and pointers 16-byte aligned) plus one that assumes nothing, so every call has a cubin. Nothing here
compiles (kdsl.aot.export) or writes (kdsl.aot.emit).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from kdsl.aot import abi as abis
from kdsl.naming import format_arch
from kdsl.runtime import registry

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def int_key(value: int) -> tuple[str, str]:
    """Triton's specialization of an integer argument: (type, claim) with claim "1" (a constexpr),
    "D" (divisible by 16) or "" (nothing assumed)."""
    kind = "i32" if INT32_MIN <= value <= INT32_MAX else "i64"
    if value == 1:
        return kind, "1"
    return kind, "D" if value % 16 == 0 else ""


def pointer_key(address: int) -> str:
    return "D" if address % 16 == 0 else ""


@dataclass
class Spec:
    """One compiled specialization of one kernel."""
    name: str
    op: str
    scheme: str
    arch: int
    entry: str  # the generated kernel (manifest name)
    impl: str
    kernel: str  # the @triton.jit function in the module
    module_path: str
    bucket: int
    tile: dict
    dtypes: dict  # dtype argument -> dtype name
    params: list  # [{name, kind: ptr|int, type, claim}]
    constexprs: dict
    options: dict
    variant: list = field(default_factory=list)  # the run-time constexprs' values, in the ImplLaunch's order
    compiled: dict = field(default_factory=dict)

    def job(self, out: Path) -> dict:
        return dict(name=self.name, module_path=self.module_path, kernel=self.kernel, arch=self.arch,
                    params=self.params, constexprs=self.constexprs, options=self.options,
                    cubin_path=str(out / "cubins" / f"{self.name}.cubin"))

    def record(self) -> dict:
        return dict(name=self.name, op=self.op, scheme=self.scheme, arch=format_arch(self.arch), entry=self.entry,
                    impl=self.impl, kernel=self.kernel, bucket=self.bucket, tile=self.tile, dtypes=self.dtypes,
                    specialization=" ".join(f"{p['name']}:{p['type']}{':' + p['claim'] if p['claim'] else ''}"
                                            for p in self.params),
                    params=self.params, constexprs=self.constexprs, options=self.options, variant=self.variant,
                    **self.compiled)


@dataclass
class Plan:
    """What `kdsl aot` will write: per (op, scheme, arch) the chosen entry and its specializations."""
    archs: list
    selected: list = field(default_factory=list)  # (abi, scheme, arch, entry, [Spec])
    skipped: list = field(default_factory=list)  # (what, reason)
    # (op, scheme, arch) -> (entry, [Spec]): the kernel that takes the calls the selected entry's exported tiles
    # cannot (no exported tile serves them, or a refusal routed to "entry"), as the registry picks it with the
    # selected entry disabled.
    fallbacks: dict = field(default_factory=dict)
    routes: list = field(default_factory=list)  # lines saying where left-out tiles' calls go

    @property
    def specs(self) -> list:
        return ([spec for *_, specs in self.selected for spec in specs]
                + [spec for _, specs in self.fallbacks.values() for spec in specs])


def choose(op: str, scheme: str, arch: int, unexportable: dict, left_out=()):
    """The registry's kernel for (op, scheme, arch), among the exportable ones and those not in `left_out`
    (entry names, as KDSL_DISABLE would name them): (entry, [(skipped, why)])."""
    skipped = []
    try:
        chosen = registry.select(op, scheme, arch=arch)
    except registry.NoKernelError as error:
        return None, [(f"{op} [{scheme}] for {format_arch(arch)}", str(error).replace("\n", ";"))]
    if chosen.impl not in unexportable and chosen.name not in left_out:
        return chosen, skipped
    # Same rule as the registry (registry._specificity), over the kernels left once the unexportable go.
    fitting = []
    for entry in registry.entries():
        if entry.op != op or entry.scheme != scheme or arch < entry.min_arch or entry.name in left_out:
            continue
        if entry.max_arch is not None and arch > entry.max_arch:
            continue
        if entry.impl in unexportable:
            skipped.append((entry.name, f"not exported: {unexportable[entry.impl]}"))
            continue
        fitting.append(entry)
    if not fitting:
        return None, skipped
    return max(fitting, key=registry._specificity), skipped


def spec_params(launch: abis.ImplLaunch, values: dict, dtypes: dict, generic: bool, split: int = 1,
                tile: dict | None = None) -> list:
    params = []
    values = {**values, "split": split}
    for name, expression in launch.params:
        if name in launch.descriptors:  # a host TMA descriptor: Triton specializes on its type and block only
            desc = launch.descriptors[name]
            element = abis.DTYPES[dtypes[desc.element.split(":", 1)[1]]][1] if desc.element.startswith("dtype:") \
                else desc.element
            block = ", ".join(str(abis.evaluate(abis.fill(b, tile or {}, {}), {})) for b in desc.block)
            params.append(dict(name=name, kind="desc", type=f"tensordesc<{element}[{block}]>", claim="",
                               rank=len(desc.shape)))
            continue
        if name in launch.pointer_types:
            kind = launch.pointer_types[name]
            if kind.startswith("scratch:"):  # split-K scratch of this type, or the output when not split
                _, element, argument = kind.split(":")
                kind = element if split > 1 else f"dtype:{argument}"
                expression = "4096" if split > 1 else expression  # allocated per context: aligned
            element = abis.DTYPES[dtypes[kind.split(":", 1)[1]]][1] if kind.startswith("dtype:") else kind
            claim = "" if generic else pointer_key(abis.evaluate(expression, values))
            params.append(dict(name=name, kind="ptr", type=f"*{element}", claim=claim))
        else:
            kind, claim = ("i32", "") if generic else int_key(abis.evaluate(abis.fill(expression, tile or {}, {}), values))
            params.append(dict(name=name, kind="int", type=kind, claim=claim))
    return params


def _spec_name(entry_name: str, bucket: int, arch: int, body: dict) -> str:
    digest = hashlib.sha256(json.dumps([arch, body], sort_keys=True).encode()).hexdigest()[:10]
    return f"{entry_name}__sm{arch}_b{bucket}_{digest}"


def plan(archs, ops=None, schemes=None, dtypes=None, generic_only: bool = False, problems=None) -> Plan:
    """Choose kernels and enumerate their specializations; compiles nothing. `problems` ({op: callable}) replaces
    an op's representative problems (abi.OpAbi.problems), e.g. with one model's sizes (kdsl.aot.model)."""
    archs = sorted(set(archs))
    result = Plan(archs=archs)

    def skip(what, why):
        if (what, why) not in result.skipped:
            result.skipped.append((what, why))

    for op in ops or list(abis.OPS):
        abi = abis.OPS[op]
        if problems and op in problems:
            abi = dataclasses.replace(abi, problems=problems[op])
        served = sorted(registry.served_schemes(op))
        for scheme in served if not schemes else [s for s in served if s in schemes]:
            for arch in archs:
                entry, skipped = choose(op, scheme, arch, abi.unexportable)
                for what, why in skipped:
                    skip(what, why)
                if entry is None:
                    continue
                # Tiles whose implementation (or kernel, within today's multi-kernel modules) is not exported:
                # reported by module and reason; their calls routed as the registry would with it disabled.
                for index, bucket in enumerate(entry.tiles):
                    why = left_out_reason(abi, entry, index)
                    if why is not None:
                        module = entry.modules.get(tile_impl(entry, bucket.params)) if hasattr(entry, "modules") else None
                        skip(Path(str(module.path)).stem if module is not None else entry.name, f"not exported: {why}")
                if not exported_buckets(abi, entry):
                    skip(entry.name, "not exported: every tile's implementation is unexportable")
                    continue
                specs = _enumerate(abi, entry, arch, dtypes, generic_only)
                if not specs:
                    allowed = sorted({d for choices in abi.dtype_choices.values() for d in choices})
                    skip(entry.name, f"not exported: no --dtype given applies to {op} (its dtypes: {', '.join(allowed)})")
                    continue
                result.selected.append((abi, scheme, arch, entry, specs))
                fallback = None
                if needs_fallback(abi, entry):
                    fallback, skipped = choose(op, scheme, arch, abi.unexportable, left_out=(entry.name,))
                    for what, why in skipped:
                        skip(what, why)
                    if fallback is not None and needs_fallback(abi, fallback):
                        fallback = None  # one level of routing; such calls are refused with a message instead
                    if fallback is not None:
                        routed = [p for p in abi.problems() if route(abi, entry, p) is None]
                        fallback_specs = _enumerate(abi, fallback, arch, dtypes, generic_only, routed)
                        result.fallbacks[(op, scheme, arch)] = (fallback, fallback_specs)
                result.routes += _route_lines(abi, entry, arch, fallback)
    return result


def _route_lines(abi: abis.OpAbi, entry, arch: int, fallback) -> list:
    """Where the calls of the tiles left out go, in words (printed by `kdsl aot`, kept in the manifest)."""
    exported = exported_buckets(abi, entry)
    lines = []
    left = [i for i in range(len(entry.tiles)) if i not in exported]
    if left:
        lines.append(f"routed {entry.name} ({format_arch(arch)}): tiles {', '.join(map(str, left))} are left out, as "
                     f"if their implementation were disabled: a call goes to the first exported tile serving its M "
                     f"and N ({', '.join(map(str, exported))}) that does not refuse it"
                     + (f", else to {fallback.name}, the registry's choice with KDSL_DISABLE={entry.name}"
                        if fallback else ""))
    for index in exported:
        launch = launch_of(abi, entry, index)
        if launch.refuses and launch.refused_to == "entry":
            lines.append(f"routed {entry.name} ({format_arch(arch)}): tile {index} refuses calls whose TMA operands "
                         f"are not 16-byte aligned (kdsl.ops copies them; C cannot): "
                         + (f"they go to {fallback.name}" if fallback else "refused with KDSL_ERR_INVALID_ARGUMENT"))
            break
    return lines


def tile_impl(entry, tile: dict) -> str:
    """The implementation serving a tile (manifest format 10: each tile names one; before, the entry's)."""
    return tile.get("impl", entry.impl)


def launch_of(abi: abis.OpAbi, entry, index: int) -> abis.ImplLaunch | None:
    return abis.launch_for(abi, entry, tile_impl(entry, entry.tiles[index].params))


def left_out_reason(abi: abis.OpAbi, entry, index: int) -> str | None:
    """Why tile `index` of the entry is not exported (None: it is): its implementation is unexportable or has no
    C launch description."""
    impl = tile_impl(entry, entry.tiles[index].params)
    if impl in abi.unexportable:
        return abi.unexportable[impl]
    launch = launch_of(abi, entry, index)
    if launch is None:
        if _is_gluon(entry, impl):  # e.g. a Gluon unit split out of a module whose Triton kernel is exported
            return (f"implementation {impl} is a Gluon kernel with no launch description (its unit's launch is a "
                    f"function of its own; the exporter compiles Gluon kernels, e.g. w4a16_gemm's gemv_mma_gluon "
                    f"and overlap_gluon, whose unit launches through a description)")
        return f"implementation {impl} has no launch description (its unit's launch is a function of its own)"
    return None


def _is_gluon(entry, impl: str) -> bool:
    """Whether the implementation's generated module defines its kernels with @gluon.jit (read, not imported)."""
    module = getattr(entry, "modules", {}).get(impl)
    try:
        return module is not None and "@gluon.jit" in Path(module.path).read_text(encoding="utf-8")
    except OSError:
        return False


def exported_buckets(abi: abis.OpAbi, entry) -> list:
    """Indices of the entry's tiles that are exported (the others' calls go to the next serving tile)."""
    return [i for i in range(len(entry.tiles)) if left_out_reason(abi, entry, i) is None]


def needs_fallback(abi: abis.OpAbi, entry) -> bool:
    """Whether some call finds no exported tile of the entry: none serves its M and N, or a refusal sends it to
    another entry, or every tile serving it refuses it and the entry's last tile (the registry's answer then)
    is not exported."""
    exported = exported_buckets(abi, entry)
    covered = any(entry.tiles[i].m_max is None and entry.tiles[i].n_min is None for i in exported)
    launches = [launch_of(abi, entry, i) for i in exported]
    last = len(entry.tiles) - 1
    safe_last = last in exported and not launch_of(abi, entry, last).refuses
    return (not covered or any(launch.refuses and launch.refused_to == "entry" for launch in launches)
            or (any(launch.refuses for launch in launches) and not safe_last))


def route(abi: abis.OpAbi, entry, call: dict, exact: bool = True) -> int | None:
    """The exported tile the dispatcher gives a call (its C arguments: at least M, N and whatever the refusals
    read; a call without them is aligned), or None where it goes to the fallback entry. The registry's
    tile_for(m, n, call) with the left-out tiles disabled: the first serving tile that does not refuse the
    call, else the last tile. A tile with EXACT constexprs also refuses a call whose value of them was not
    exported (exact=False: not, the rule that decides which values are)."""
    m, n = bucket_m(abi, call), call[abi.n] if abi.n else None
    scheme = abis.scheme_values(entry)
    exported = exported_buckets(abi, entry)
    served = False
    for index in exported:
        bucket = entry.tiles[index]
        if not bucket.serves(m, n):
            continue
        served = True
        launch = launch_of(abi, entry, index)
        if launch.refuses and _refused(abi, launch, bucket.params, scheme, call):
            if launch.refused_to == "entry":
                return None
            continue
        if exact and _exact_refused(abi, entry, index, launch, call):
            continue
        return index
    last = len(entry.tiles) - 1
    return last if served and last in exported else None


def bucket_m(abi: abis.OpAbi, call: dict) -> int:
    """The M the registry buckets this call by (abi.OpAbi.m: an argument, or an expression of the arguments)."""
    return call[abi.m] if abi.m in call else abis.evaluate(abi.m, _call_values(abi, call))


def _call_values(abi: abis.OpAbi, call: dict) -> dict:
    values = {**call, **{k: abis.DTYPE_CODES[v] for k, v in call.items() if isinstance(v, str) and v in abis.DTYPES}}
    for arg in abi.args:
        if arg.ctype == "ptr":
            values.setdefault(arg.name, 4096)  # problems name no pointers: allocations are aligned
    return values


def _refused(abi: abis.OpAbi, launch: abis.ImplLaunch, tile: dict, scheme: dict, call: dict) -> bool:
    return bool(abis.evaluate(abis.fill(launch.refuses, tile, scheme), _call_values(abi, call)))


def exact_names(launch: abis.ImplLaunch) -> list:
    return [(name, expression) for name, expression, allowed in launch.runtime_constexprs if allowed == abis.EXACT]


_EXACT_VALUES: dict = {}


def exact_values(abi: abis.OpAbi, entry, index: int) -> dict:
    """{constexpr: sorted values} for tile `index`'s EXACT constexprs: the values the op's representative problems
    that reach the tile (by M, N and the refusals) give them; where none reaches it, those of the problems moved to
    its M and N bounds (as _enumerate compiles such a tile). Each is compiled; the tile refuses other values."""
    launch = launch_of(abi, entry, index)
    names = exact_names(launch) if launch is not None else []
    if not names:
        return {}
    key = (abi.op, abi.problems, entry.name, index)
    found = _EXACT_VALUES.get(key)
    if found is None:
        tile, scheme = entry.tiles[index].params, abis.scheme_values(entry)
        seen = {name: set() for name, _ in names}
        problems = list(abi.problems())
        reaching = [p for p in problems if route(abi, entry, p, exact=False) == index]
        if not reaching:
            reaching = [p for p in _moved(abi, entry, index, problems) if route(abi, entry, p, exact=False) == index]
        for problem in reaching:
            values = _call_values(abi, problem)
            for name, expression in names:
                seen[name].add(abis.evaluate(abis.fill(expression, tile, scheme), values))
        found = _EXACT_VALUES[key] = {name: sorted(v) for name, v in seen.items()}
    return found


def _exact_refused(abi: abis.OpAbi, entry, index: int, launch: abis.ImplLaunch, call: dict) -> bool:
    names = exact_names(launch)
    if not names:
        return False
    allowed = exact_values(abi, entry, index)
    values = _call_values(abi, call)
    scheme = abis.scheme_values(entry)
    tile = entry.tiles[index].params
    return any(abis.evaluate(abis.fill(expression, tile, scheme), values) not in allowed[name]
               for name, expression in names)


def runtime_values(launch: abis.ImplLaunch, tile: dict, scheme: dict, values: dict) -> dict:
    """The constexprs the launch computes from this call's arguments (a K split: for the device's `sms`)."""
    out = {}
    for name, expression, allowed in launch.runtime_constexprs:
        value = abis.evaluate(abis.fill(expression, tile, scheme), values)
        out[name] = value if allowed in (abis.SPLIT, abis.EXACT) else bool(value) if isinstance(allowed[0], bool) else value
    return out


def split_name(launch: abis.ImplLaunch) -> str | None:
    return next((name for name, _, allowed in launch.runtime_constexprs if allowed == abis.SPLIT), None)


def _runtime_choices(launch: abis.ImplLaunch, tile: dict, scheme: dict, values: dict) -> list:
    """Every (constexpr combination, SM count) this call can take: per SM count planned for, the split the launch
    takes there, and 1 (a persistent grid also follows the SM count)."""
    split = split_name(launch)
    out = []
    for sms in abis.SPLIT_SMS:
        runtime = runtime_values(launch, tile, scheme, {**values, "sms": sms})
        for value in sorted({runtime[split], 1}) if split else [None]:
            choice = {**runtime, split: value} if split else runtime
            if (choice, sms) not in out:
                out.append((choice, sms))
    return out


def _enumerate(abi: abis.OpAbi, entry, arch: int, dtypes, generic_only: bool, problems=None) -> list:
    """The entry's specializations for the op's representative problems (or `problems`: those another
    entry routes to this one)."""
    scheme = abis.scheme_values(entry)
    wanted = {}
    # Every problem names one dtype per dtype argument; generic specs for each allowed combination.
    combos = [{}]
    for argument, allowed in abi.dtype_choices.items():
        allowed = [d for d in allowed if not dtypes or d in dtypes]
        combos = [{**c, argument: d} for c in combos for d in allowed]
    problems = list(abi.problems() if problems is None else problems)
    for bucket_index in exported_buckets(abi, entry):
        tile = entry.tiles[bucket_index].params
        impl = tile_impl(entry, tile)
        launch = abis.launch_for(abi, entry, impl)
        module = entry.modules[impl] if hasattr(entry, "modules") else entry
        module_path = str(getattr(module, "path", None) or module.module_path)
        kernel = launch.kernel.format(entry=entry.name, impl=impl, module=Path(module_path).stem)
        split = split_name(launch)
        calls, seen_runtime = [], {}  # per dtype combination: the constexpr combinations its problems reach
        reaching = [p for p in problems
                    if route(abi, entry, p) == bucket_index]
        if not reaching:  # no representative size reaches this tile: the problems moved to its M and N bounds
            moved = _moved(abi, entry, bucket_index, problems)
            reaching = [p for p in moved if route(abi, entry, p) == bucket_index]
            if not reaching:
                # A tile only the calls its predecessors refuse reach (an alternative): the moved problems with their
                # flag arguments varied. Without a problem, every declared value of each run-time constexpr would be
                # combined with every other (below), values that one call never takes together and that need not
                # compile (planes_mma's ASM_DEQUANT without UNIFORM_GROUP).
                reaching = [p for p in _flag_variants(abi, moved) if route(abi, entry, p) == bucket_index]
        for problem in reaching:
            problem_dtypes = {a: problem[a] for a in abi.dtype_choices}
            if problem_dtypes not in combos:
                continue
            if route(abi, entry, problem) != bucket_index:
                continue
            # Pointers as the deployments' allocators give them: 16-byte aligned (misaligned ones take the
            # generic specialization); NULL stays NULL (an optional tensor left out).
            values = {**problem, **{a.name: 4096 if problem.get(a.name, 1) else 0 for a in abi.args if a.ctype == "ptr"},
                      **{a: abis.DTYPE_CODES[problem[a]] for a in abi.dtype_choices}}  # as C sees them: kdsl_dtype
            seen = seen_runtime.setdefault(json.dumps(problem_dtypes, sort_keys=True), [])
            for runtime, sms in _runtime_choices(launch, tile, scheme, values):
                if runtime not in seen:
                    seen.append(runtime)
                if not generic_only:
                    calls.append((problem_dtypes, {**values, "sms": sms}, runtime, False))
        if abi.call_flags and reaching:
            # Every combination of the flag arguments, unsplit, for each dtype combination.
            flags = [{}]
            for argument, choices in abi.call_flags.items():
                flags = [{**f, argument: v} for f in flags for v in choices]
            for combo in combos:
                seen = seen_runtime.setdefault(json.dumps(combo, sort_keys=True), [])
                for flag in flags:
                    values = {**reaching[0], **combo, **flag, "sms": abis.SPLIT_SMS[0]}
                    values.update({a.name: 4096 if values.get(a.name, 1) else 0 for a in abi.args if a.ctype == "ptr"})
                    values.update({a: abis.DTYPE_CODES[combo[a]] for a in abi.dtype_choices})
                    runtime = runtime_values(launch, tile, scheme, values)
                    if split:
                        runtime[split] = 1
                    if runtime not in seen:
                        seen.append(runtime)
        generic_calls = []
        exact = exact_values(abi, entry, bucket_index)
        for combo in combos:
            seen = seen_runtime.get(json.dumps(combo, sort_keys=True))
            if not seen:  # no representative call reaches this tile: every declared combination (no split)
                seen = [{}]
                for name, _, allowed in launch.runtime_constexprs:
                    choices = (1,) if allowed == abis.SPLIT else exact[name] if allowed == abis.EXACT else allowed
                    seen = [{**r, name: v} for r in seen for v in choices]
            elif exact:  # every exported value of the EXACT constexprs with every combination of the others
                widened = []
                for runtime in seen:
                    options = [runtime]
                    for name, values in exact.items():
                        options = [{**r, name: v} for r in options for v in values]
                    widened += [r for r in options if r not in widened]
                seen = widened
            generic_calls += [(combo, {}, runtime, True) for runtime in seen]
        # The assumption-free specializations first: one per dtype and run-time constexpr combination.
        for dtype_choice, values, runtime, generic in generic_calls + calls:
            params = spec_params(launch, values, dtype_choice, generic, runtime.get(split, 1) if split else 1,
                                 tile)
            # The scheme's numbers (GROUP_SIZE, ...) are constexprs of the kernels of every scheme sharing the module:
            # an exported kernel is specialized per scheme.
            constexprs = {**launch.constexprs(tile, scheme), **getattr(entry, "constexprs", {}), **runtime}
            if launch.releases:  # griddepcontrol: sm_90 and later (as kdsl.kernels.host.dependent_launches)
                constexprs["RELEASE"] = arch >= 90
            if launch.dtype_constexprs:
                constexprs.update(launch.dtype_constexprs(dtype_choice))
            fixed = dict(constexprs=constexprs, options=launch.options(tile))
            body = dict(params=params, kernel=kernel, **fixed)
            name = _spec_name(entry.name, bucket_index, arch, body)
            if name not in wanted:
                wanted[name] = Spec(name=name, op=abi.op, scheme=entry.scheme, arch=arch, entry=entry.name,
                                    impl=impl, kernel=kernel, module_path=module_path,
                                    bucket=bucket_index, tile=dict(tile), dtypes=dict(dtype_choice),
                                    params=params, variant=[int(runtime[n]) for n, *_ in launch.runtime_constexprs],
                                    **fixed)
    return list(wanted.values())


def _flag_variants(abi: abis.OpAbi, problems: list) -> list:
    """Each problem with every combination of the op's flag arguments (abi.call_flags)."""
    variants = problems
    for argument, choices in (abi.call_flags or {}).items():
        variants = [{**p, argument: value} for p in variants for value in choices]
    return variants


def _moved(abi: abis.OpAbi, entry, index: int, problems: list) -> list:
    """The problems moved to tile `index`'s bounds: M at its m_max (for the last tile, just past the others'), N at
    least its n_min."""
    bucket = entry.tiles[index]
    m = bucket.m_max if bucket.m_max is not None else 1 + max(
        [b.m_max for b in entry.tiles if b.m_max is not None], default=0)
    at_m = abi.with_m or (lambda problem, value: {**problem, abi.m: value})
    return [{**at_m(p, m), **({abi.n: max(p[abi.n], bucket.n_min)} if abi.n and bucket.n_min is not None else {})}
            for p in problems]

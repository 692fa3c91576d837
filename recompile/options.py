"""RecompileOptions: what ``torch.compile(..., backend="rec_ascend", options={...})`` accepts."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from recompile.lowering.targets import TARGETS
from recompile.runtime.embedding_optimizer import OPTIMIZERS, format_optimizer

OFFLOAD = ("partial", "full")
BOUNDS_CHECK = ("fatal", "warning", "ignore")
DEFAULT_COMPILE_BUDGET = 1.5


@dataclass
class RecompileOptions:
    # "auto" picks the best device present; naming an absent one is allowed only for explain/plans.
    target: str = "auto"
    # Rec SDK modes: "partial" hashes/dedups/bucketizes ids on the host, "full" does it all on device.
    offload: str = "partial"
    # Enable or disable passes by name: {"embedding": False}.
    passes: dict[str, bool] = field(default_factory=dict)
    # Write every stage's graph as Python and JSON here (env RECOMPILE_DUMP sets it too).
    dump_dir: str | None = None
    # Run each pass's result against its input graph on the example inputs; raise on mismatch.
    verify: bool = False
    # Out-of-range ids: "fatal" raises naming the table, "warning" and "ignore" as FBGEMM's BoundsCheckMode.
    bounds_check: str = "fatal"
    # Time candidate kernels on the example inputs and keep the fastest correct one.
    autotune: bool = True
    # Fused optimizer for the grouped embedding tables: {"type": "exact_rowwise_adagrad", "lr": 0.01, ...};
    # None: the tables get ordinary gradients. See EMBEDDING_OPTIMIZER_KEYS.
    embedding_optimizer: dict | None = None
    # A graph's cold compile may take this many times plain Inductor's compile of it: the race compiles a second
    # Inductor candidate only within it (recompile.autotune.CompileBudget). None: no limit, the default under
    # torch.compile's mode="max-autotune" / "max-autotune-no-cudagraphs".
    compile_budget: float | None = DEFAULT_COMPILE_BUDGET

    def __post_init__(self):
        _check_choice("target", self.target, TARGETS)
        _check_choice("offload", self.offload, OFFLOAD)
        _check_choice("bounds_check", self.bounds_check, BOUNDS_CHECK)
        for name in ("verify", "autotune"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"recompile option {name!r} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.passes, Mapping):
            raise ValueError(f"recompile option 'passes' must be a dict of pass name -> bool, got {self.passes!r}")
        from recompile.pipeline import PASS_ORDER

        for name, on in self.passes.items():
            _check_choice("passes", name, tuple(PASS_ORDER))
            if not isinstance(on, bool):
                raise ValueError(f"recompile option passes[{name!r}] must be True or False, got {on!r}")
        _check_embedding_optimizer(self.embedding_optimizer)
        budget = self.compile_budget
        if budget is not None and (type(budget) not in (int, float) or not budget >= 1.0):
            raise ValueError(f"recompile option 'compile_budget' must be a number >= 1.0 (times plain Inductor's "
                             f"compile) or None (no limit), got {budget!r}")
        if self.dump_dir is None:
            self.dump_dir = os.environ.get("RECOMPILE_DUMP") or None

    def enabled(self, pass_name: str) -> bool:
        return self.passes.get(pass_name, True)

    @classmethod
    def coerce(cls, options: "RecompileOptions | Mapping[str, Any] | None") -> "RecompileOptions":
        """Accept None, a RecompileOptions or a dict; reject unknown keys, listing the valid ones."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(f"recompile options must be a dict or RecompileOptions, got {type(options).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown recompile option(s) {unknown}; valid options: {', '.join(valid)}")
        return cls(**options)


EMBEDDING_OPTIMIZER_KEYS = ("type", "lr", "eps", "betas")


def _check_embedding_optimizer(spec: Any) -> None:
    if spec is None:
        return
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ValueError(f"recompile option 'embedding_optimizer' must be a dict with a 'type', got {spec!r}")
    unknown = sorted(set(spec) - set(EMBEDDING_OPTIMIZER_KEYS))
    if unknown:
        raise ValueError(f"unknown embedding_optimizer key(s) {unknown}; valid keys: {', '.join(EMBEDDING_OPTIMIZER_KEYS)}")
    _check_choice("embedding_optimizer.type", spec["type"], OPTIMIZERS)
    for key in ("lr", "eps"):
        value = spec.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"recompile option embedding_optimizer[{key!r}] must be a positive number, got {value!r}")
    betas = spec.get("betas", (0.9, 0.999))
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"recompile option embedding_optimizer['betas'] must be two numbers in [0, 1), got {betas!r}")


def embedding_optimizer_spec(spec: Mapping[str, Any]) -> str:
    """The optimizer as the fused lookup op spells it."""
    beta1, beta2 = spec.get("betas", (0.9, 0.999))
    params = {k: spec[k] for k in ("lr", "eps") if k in spec}
    return format_optimizer(spec["type"], beta1=beta1, beta2=beta2, **params)


def _check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"recompile option {name!r} got {value!r}; valid values: {', '.join(valid)}")

"""TrainState, the optimizer, and how a state is stored on a plan (`StateLayout`).

`abstract = eval_shape(init)` -> `shardings(abstract, mesh)` -> `jit(init, out_shardings)`: the
same functions give the fresh state, the restore target of a checkpoint on a new mesh and the
target layout of a transition, so resharding after a failure is not a special code path.
Initial values depend on `train.seed` only (threefry is partitionable), never on the mesh.

With ZeRO (stage >= 1) the optimizer state lives in the `storage.ZeroCodec` storage layout of the
plan (and, for stage 3, the parameters too). The *canonical* form of a state is the ZeRO-0 form:
full parameters and an optimizer state shaped like them. Checkpoints store the canonical form,
so they restore onto any plan; checksums are computed on the storage directly but are defined
on canonical element identities, so they compare across plans.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import models
from ..config import (
    Config,
    ConfigError,
    check_custom_optimizer,
    optimizer_spec_ok,
)
from ..core import treesum
from ..core.mesh import DATA, STAGE, TENSOR
from ..core.packing import all_gather_packed
from ..core.rng import root_key
from ..core.sharding import named_shardings, opt_state_logical, path_str
from ..observe.events import import_user_module
from ..transfer import checksum
from .pipeline import StageLayout, from_slots, slot_logical, to_slots
from .storage import ZeroCodec

PyTree = Any
MAX_LAYOUTS = 32  # StateFactory.layout keeps this many forms


def form_key(plan) -> tuple:
    """What a plan's state form depends on: tensor degree, ZeRO stage and layout, partition."""
    return (plan.tensor, plan.zero_stage, plan.zero, plan.partition)


@flax.struct.dataclass
class TrainState:
    """Only arrays: the step counter, parameters and optimizer state."""

    step: jax.Array
    params: PyTree
    opt_state: PyTree


BUILTIN_OPTIMIZER = "builtin adamw"  # how the start event and reports name the default


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The run's optimizer by config: the user's `train.optimizer` (`load_optimizer`) if set,
    else the built-in AdamW with linear warmup and cosine decay, after global-norm clipping
    (in the step instead where the mode in force, `cfg.deterministic`, is deterministic)."""
    t = cfg.train
    if t.optimizer:
        return load_optimizer(t.optimizer)
    sched = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=max(t.warmup_steps, 1),
        decay_steps=max(t.steps, t.warmup_steps + 1),
        end_value=t.lr * 0.1,
    )
    parts = []
    if t.grad_clip > 0:
        # deterministic mode clips in the step with a layout-independent norm
        # (`StateLayout.fixed_order_norm`); identity keeps the optimizer state's structure
        clip = optax.identity() if cfg.deterministic else optax.clip_by_global_norm(t.grad_clip)
        parts.append(clip)
    parts.append(optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=t.weight_decay))
    return optax.chain(*parts)


def load_optimizer(spec: str) -> optax.GradientTransformation:
    """`MODULE:ATTR` (`train.optimizer`, `--optimizer`) -> the optimizer. The module is imported
    as `--import` does (the current directory first); ATTR is an optax `GradientTransformation`
    or a zero-argument callable returning one. The callable takes no config on purpose: the
    module holds all of its optimizer's settings, so `train.optimizer` names the whole optimizer
    and the built-in optimizer's config fields cannot half-apply to it. Under `elasjax launch`
    every process calls this itself, so the module must not create JAX arrays at import."""
    flag = f"train.optimizer = {spec!r}:"
    if not optimizer_spec_ok(spec):
        raise ConfigError(f"config {flag} allowed values: '' (the built-in AdamW) or MODULE:ATTR")
    mod, _, attr = spec.partition(":")
    obj = getattr(import_user_module(mod, "config 'train.optimizer':"), attr, None)
    if obj is None:
        raise ConfigError(f"config {flag} module {mod!r} has no attribute {attr!r}")
    if not isinstance(obj, optax.GradientTransformation):
        if not callable(obj):
            raise ConfigError(
                f"config {flag} {mod}.{attr} is a {type(obj).__name__}; allowed: an optax "
                "GradientTransformation or a zero-argument callable returning one"
            )
        try:
            obj = obj()
        except TypeError as e:
            raise ConfigError(
                f"config {flag} calling {mod}.{attr}() failed ({e}); allowed: an optax "
                "GradientTransformation or a zero-argument callable returning one (wrap "
                f"optax's factories: {attr} = optax.lamb(1e-3))"
            ) from None
        if not isinstance(obj, optax.GradientTransformation):
            raise ConfigError(
                f"config {flag} {mod}.{attr}() returned a {type(obj).__name__}; allowed: an "
                "optax GradientTransformation"
            )
    return obj


def optimizer_label(tx: optax.GradientTransformation) -> str:
    """How a run names an optimizer object passed to it in Python (a transformation has no name
    of its own: its `init`'s qualified name says which factory built it)."""
    init = getattr(tx, "init", None)
    where = f"{getattr(init, '__module__', '?')}.{getattr(init, '__qualname__', '?')}"
    return f"python object {type(tx).__name__} (init {where})"


def choose_optimizer(
    cfg: Config, optimizer: optax.GradientTransformation | None = None
) -> tuple[optax.GradientTransformation, str, str]:
    """The run's optimizer: (transformation, label, source). `source` is `builtin` (AdamW by
    `train`), `config` (`train.optimizer`, label MODULE:ATTR) or `python` (`optimizer`, passed
    to `run`; label `optimizer_label`). A custom optimizer with `train` fields it would leave
    unused is a `ConfigError` naming them (`config.check_custom_optimizer`)."""
    t = cfg.train
    if optimizer is not None:
        if t.optimizer:
            raise ConfigError(
                f"config 'train.optimizer' = {t.optimizer!r} and an optimizer passed to run() "
                "both name the optimizer; allowed: one of them (train.optimizer = '' with "
                "optimizer=, or no optimizer= argument)"
            )
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(
                f"optimizer= is a {type(optimizer).__name__}; allowed: an optax "
                "GradientTransformation (or None for the config's optimizer)"
            )
        label = optimizer_label(optimizer)
        check_custom_optimizer(t, f"{label} (passed to run)")
        return optimizer, label, "python"
    if t.optimizer:
        return load_optimizer(t.optimizer), t.optimizer, "config"
    return make_optimizer(cfg), BUILTIN_OPTIMIZER, "builtin"


def _is_tag(x) -> bool:
    return isinstance(x, str)


class StateFactory:
    """Model, optimizer and canonical (ZeRO-0) state shapes; `layout(plan)` for a plan's form."""

    def __init__(self, cfg: Config, tx: optax.GradientTransformation, *, custom_tx: bool = False):
        self.cfg, self.tx = cfg, tx
        # a user's optimizer is part of what an executable depends on (the default is fixed by
        # `cfg.train`, which the executable cache keys on already)
        self.tx_key = tx if custom_tx else None
        self.model = models.get(cfg.model_in_force)  # its ModelSpec, `model.remat` resolved
        self.abstract = jax.eval_shape(self._init)
        self.param_logical = self.model.logical_specs()
        self.logical = TrainState(
            step=PartitionSpec(),
            params=self.param_logical,
            opt_state=opt_state_logical(
                tx, self.abstract.opt_state, self.param_logical, self.abstract.params
            ),
        )
        self._layouts: OrderedDict = OrderedDict()
        self._layouts_lock = threading.Lock()  # the standby and transfer-plan threads ask too

    def _init_params(self):
        key = jax.random.fold_in(root_key(self.cfg.train.seed), 0x1A17)
        return self.model.init_params(key)

    def _init(self) -> TrainState:
        params = self._init_params()
        return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params))

    @property
    def n_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.abstract.params))

    # canonical (ZeRO-0) helpers, kept for callers that do not care about ZeRO
    def shardings(self, mesh: Mesh) -> TrainState:
        return named_shardings(self.abstract, self.logical, mesh)

    def abstract_on(self, mesh: Mesh) -> TrainState:
        sh = self.shardings(mesh)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract, sh
        )

    def init(self, mesh: Mesh) -> TrainState:
        return jax.jit(self._init, out_shardings=self.shardings(mesh))()

    def layout(self, plan) -> "StateLayout":
        """The state's form on `plan`, one object per form, the `MAX_LAYOUTS` most recently used
        kept (a long elastic run meets a new form at most plan changes)."""
        key = form_key(plan)
        with self._layouts_lock:  # the standby and transfer-plan threads ask too
            lay = self._layouts.pop(key, None) or StateLayout(self, plan)
            self._layouts[key] = lay
            while len(self._layouts) > MAX_LAYOUTS:
                self._layouts.popitem(last=False)
            return lay


class StateLayout:
    """The form of the TrainState on one plan: ZeRO-0 (canonical) or a ZeRO storage layout."""

    def __init__(self, factory: StateFactory, plan):
        self.factory, self.tx = factory, factory.tx
        # what identifies the form (by value: plans and caches keyed by it survive eviction)
        self.key = form_key(plan)
        self.stage = plan.zero_stage
        self.stage_layout = StageLayout(plan.partition) if plan.stage > 1 else None
        self.codec = None
        if self.stage > 0 and self.stage_layout is None:
            self.codec = ZeroCodec(
                factory.abstract.params, factory.param_logical, plan.zero, plan.tensor
            )
        elif self.stage > 0:
            # ZeRO on a pipeline: the codec partitions the slot-form parameters with the slot
            # axes flattened ([S * Lmax, ...], sharded over `stage`), one layer at a time
            flat = jax.eval_shape(
                lambda p: self._flat_slots(self._slots(p)), factory.abstract.params
            )
            self.codec = ZeroCodec(
                flat, factory.param_logical, plan.zero, plan.tensor,
                layer_ids=self.stage_layout.slot_layer().reshape(-1), layer_axis=STAGE,
            )
        # from the canonical shapes: tracing the model's init again would cost far more
        self.abstract = jax.eval_shape(self.from_canonical, factory.abstract)
        # per leaf of the optimizer state: the ZeRO storage leaf it follows ("unit\x00tier"), or
        # "" (a count, a schedule's state). Found once here: `optax.tree_map_params` runs the
        # optimizer's init on placeholders, eagerly, a small program on the current client; at
        # every `shardings` call it compiled once more on each renewed CPU client, the one
        # compile of a ZeRO standby hit under launch (experiments/RESULTS.md, "The standby's
        # plans spread over the processes")
        self._opt_tags = self._opt_state_tags() if self.codec is not None else None
        # per leaf of `abstract` (flatten order): (key, ZeRO storage unit or None, tier); what
        # the transition planner and the checkpoint read a layout by (`transfer.matching.LeafTag`)
        self.tags = self._leaf_tags()
        self._slot_leaf = [
            self.stage_layout is not None and unit is None and "layers" in key.split("/")
            for key, unit, _ in self.tags
        ]
        # the order of `stacked_checksums`' rows
        self.checksum_keys = sorted(jax.eval_shape(self.checksums, self.abstract))

    # -- pipeline slots -------------------------------------------------------------------------

    def _slots(self, params: PyTree) -> PyTree:
        return {**params, "layers": to_slots(params["layers"], self.stage_layout)}

    def _unslots(self, params: PyTree) -> PyTree:
        return {**params, "layers": from_slots(params["layers"], self.stage_layout)}

    @staticmethod
    def _flat_slots(params: PyTree) -> PyTree:
        """[S, Lmax, ...] slot leaves -> [S * Lmax, ...] (stage-major, so sharding over `stage`
        on the first axis keeps every stage's slots on its devices)."""
        layers = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), params["layers"])
        return {**params, "layers": layers}

    def _unflat_slots(self, params: PyTree) -> PyTree:
        S, L = self.stage_layout.stages, self.stage_layout.slots
        layers = jax.tree.map(lambda x: x.reshape((S, L) + x.shape[1:]), params["layers"])
        return {**params, "layers": layers}

    # -- ZeRO storage of parameter-shaped trees (in this layout's params form) ------------------

    def to_storage(self, params: PyTree, mesh: Mesh | None = None,
                   ready: frozenset[str] = frozenset()) -> PyTree:
        """Parameter-shaped tree (this layout's params form) -> ZeRO storage; given the `mesh`
        it is laid out on, per device (`ZeroCodec.to_storage`; `ready`: leaves given as their
        storage tier already)."""
        if self.stage_layout is not None:
            params = self._flat_slots(params)
        return self.codec.to_storage(params, mesh, ready)

    def from_storage(self, storage: PyTree, mesh: Mesh | None = None) -> PyTree:
        params = self.codec.from_storage(storage, mesh)
        return self._unflat_slots(params) if self.stage_layout is not None else params

    # -- construction ---------------------------------------------------------------------------

    def from_canonical(self, full: TrainState) -> TrainState:
        """Traceable: canonical state -> this layout."""
        if self.stage_layout is not None:
            like = self.factory.abstract.params
            if self.codec is None:
                conv = self._slots
            else:
                conv = lambda p: self.to_storage(self._slots(p))  # noqa: E731
            opt = self._map_param_parts(full.opt_state, like, conv)
            return TrainState(full.step, self._slots(full.params), opt)
        if self.codec is None:
            return full
        c = self.codec
        params = c.to_storage(full.params) if self.stage == 3 else full.params
        opt = self._map_param_parts(full.opt_state, self.factory.abstract.params, c.to_storage)
        return TrainState(full.step, params, opt)

    def to_canonical(self, state: TrainState) -> TrainState:
        """Traceable: this layout -> canonical state."""
        if self.stage_layout is not None:
            if self.codec is None:
                like = jax.eval_shape(self._slots, self.factory.abstract.params)
                conv = self._unslots
            else:
                like = self.codec.abstract_storage()
                conv = lambda st: self._unslots(self.from_storage(st))  # noqa: E731
            opt = self._map_param_parts(state.opt_state, like, conv)
            return TrainState(state.step, self._unslots(state.params), opt)
        if self.codec is None:
            return state
        c = self.codec
        params = c.from_storage(state.params) if self.stage == 3 else state.params
        like = c.abstract_storage()
        opt = self._map_param_parts(state.opt_state, like, c.from_storage)
        return TrainState(state.step, params, opt)

    def init_fn(self) -> TrainState:
        return self.from_canonical(self.factory._init())

    def _map_param_parts(self, opt_state, like, fn):
        """Apply `fn` to every sub-tree of `opt_state` shaped like `like` (Adam's moments)."""
        target = jax.tree_util.tree_structure(like)
        return jax.tree.map(
            lambda sub: fn(sub) if jax.tree_util.tree_structure(sub) == target else sub,
            opt_state,
            is_leaf=lambda sub: jax.tree_util.tree_structure(sub) == target,
        )

    # -- shardings ------------------------------------------------------------------------------

    def shardings(self, mesh: Mesh) -> TrainState:
        f = self.factory
        if self.stage_layout is not None:
            p_logical = {**f.param_logical, "layers": slot_logical(f.param_logical["layers"])}
            if self.codec is None:
                logical = TrainState(
                    PartitionSpec(),
                    p_logical,
                    opt_state_logical(
                        self.tx, self.abstract.opt_state, p_logical, self.abstract.params
                    ),
                )
                return named_shardings(self.abstract, logical, mesh)
            param_sh = named_shardings(self.abstract.params, p_logical, mesh)
            rep = NamedSharding(mesh, PartitionSpec())
            return TrainState(rep, param_sh, self._opt_storage_shardings(mesh))
        full_param_sh = self.param_shardings(mesh)
        if self.codec is None:
            return named_shardings(f.abstract, f.logical, mesh)
        store_sh = self.codec.storage_shardings(mesh)
        rep = NamedSharding(mesh, PartitionSpec())
        opt_sh = self._opt_storage_shardings(mesh)
        return TrainState(rep, store_sh if self.stage == 3 else full_param_sh, opt_sh)

    def param_shardings(self, mesh: Mesh):
        """The parameters' shardings in parameter form (the ZeRO-0 layout, tensor-sharded), for
        an unpipelined plan: what ZeRO-3 gathers its storage into."""
        f = self.factory
        return named_shardings(f.abstract.params, f.param_logical, mesh)

    def _opt_storage_shardings(self, mesh: Mesh):
        storage = self.codec.storage_shardings(mesh)
        rep = NamedSharding(mesh, PartitionSpec())

        def one(tag: str) -> NamedSharding:
            if not tag:
                return rep
            unit, tier = tag.split("\x00")
            return storage[unit][int(tier)]

        return jax.tree.map(one, self._opt_tags, is_leaf=_is_tag)

    def abstract_on(self, mesh: Mesh) -> TrainState:
        sh = self.shardings(mesh)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract, sh
        )

    # -- checksums -------------------------------------------------------------------------------

    def _storage_tags(self) -> dict[str, tuple[str, ...]]:
        """The ZeRO storage's tree (`ZeroCodec.storage_shardings`' structure), each leaf tagged
        "unit\x00tier"."""
        return {
            u.name: tuple(f"{u.name}\x00{i}" for i in range(len(self.codec.tables)))
            for u in self.codec.units
        }

    def _opt_state_tags(self):
        """Per leaf of the optimizer state: its storage leaf's tag, or "" (see `__init__`)."""
        return optax.tree_map_params(
            self.tx,
            lambda _, t: t,
            self.abstract.opt_state,
            self._storage_tags(),
            transform_non_params=lambda _: "",
            is_leaf=_is_tag,
        )

    def _leaf_tags(self) -> list[tuple[str, str | None, int]]:
        """Per leaf of the abstract state (flatten order): (key, storage unit or None, tier)."""
        if self.codec is None:
            return [(path_str(p), None, 0) for p, _ in jax.tree_util.tree_flatten_with_path(self.abstract)[0]]
        params = (self._storage_tags() if self.stage == 3
                  else jax.tree.map(lambda _: "", self.abstract.params))
        tagged = TrainState("", params, self._opt_tags)
        tags = jax.tree.leaves(tagged, is_leaf=_is_tag)
        out = []
        for (path, _), tag in zip(jax.tree_util.tree_flatten_with_path(self.abstract)[0], tags):
            key = path_str(path)
            if tag:
                unit, tier = tag.split("\x00")
                prefix = key[: key.rindex(unit) - 1] if unit in key else key
                out.append((f"{prefix}::{unit}", unit, int(tier)))
            else:
                out.append((key, None, 0))
        return out

    def checksums(self, state: TrainState, mesh: Mesh | None = None) -> dict[str, jax.Array]:
        """Traceable: {key: uint32[2]} with layout-independent element identities. Given the
        `mesh` the state is laid out on (by `shardings(mesh)`), sharded and large plain leaves
        and the ZeRO storage are hashed once over the mesh, each device its own block
        (`checksum.mesh_checksums`, `_storage_sums`), not gathered or hashed on every device
        holding a copy; the values are the same."""
        out: dict[str, jax.Array] = {}
        storage: dict[tuple[str, int], list[tuple[str, jax.Array]]] = {}
        specs = None if mesh is None else [
            s.spec for s in jax.tree.leaves(self.shardings(mesh))
        ]
        plain: list[tuple[str, jax.Array, Any]] = []
        whole: list[tuple[str, jax.Array]] = []  # hashed as one array (GSPMD gathers it)
        slots: list[tuple[str, jax.Array]] = []
        for i, ((key, unit, tier), slot, x) in enumerate(
            zip(self.tags, self._slot_leaf, jax.tree.leaves(state))
        ):
            if slot:
                slots.append((key, x))
            elif unit is None:
                if specs is not None and checksum.on_mesh(x.shape, specs[i], mesh):
                    plain.append((key, x, specs[i]))
                else:
                    whole.append((key, x))
            else:  # Adam's moments share every storage tier's element identities
                storage.setdefault((unit, tier), []).append((key, x))
        if whole:
            rows = checksum.leaf_checksums([x for _, x in whole])
            out.update((key, rows[i]) for i, (key, _) in enumerate(whole))
        if slots:
            rows = self._slot_checksums([x for _, x in slots])
            out.update((key, rows[i]) for i, (key, _) in enumerate(slots))
        if storage:
            keys = [k for group in storage.values() for k, _ in group]
            rows = self._storage_sums(storage, mesh)
            for i, key in enumerate(keys):  # a family's tiers add up to one checksum
                out[key] = out[key] + rows[i] if key in out else rows[i]
        if plain:
            rows = checksum.mesh_checksums([x for _, x, _ in plain], [s for *_, s in plain], mesh)
            for i, (key, _, _) in enumerate(plain):
                out[key] = rows[i]
        return out

    def _storage_sums(self, groups: dict, mesh: Mesh | None) -> jax.Array:
        """uint32[n, 2]: the checksum of each ZeRO storage leaf of `groups` ((unit, tier) ->
        [(key, array)]), in order, at its elements' canonical identities
        (`ZeroCodec.storage_identity`). Given the `mesh`, each device hashes its own block (a
        block replicated over axes the storage does not use is shared out among its holders)
        and one all-reduce adds them up; otherwise every rank and row is hashed from the global
        arrays."""
        codec = self.codec
        order = list(groups)
        if mesh is None:
            rows = []
            for unit, tier in order:
                u = codec.unit(unit)
                xs = [x for _, x in groups[unit, tier]]
                W = xs[0].shape[-1]
                rank = jax.lax.broadcasted_iota(jnp.uint32, (codec.layout.data, u.rows, W), 0)
                row = jax.lax.broadcasted_iota(jnp.uint32, (codec.layout.data, u.rows, W), 1)
                cols = jax.lax.broadcasted_iota(jnp.uint32, (codec.layout.data, u.rows, W), 2)
                g, valid = codec.storage_identity(u, tier, rank, row)(None, cols)
                if u.batch_shape:
                    lid = jnp.asarray(np.asarray(codec.stacked_layer_ids(u), np.int32))
                    lid = lid.reshape(-1, 1, 1, 1)
                    g = g[None] + lid.astype(jnp.uint32) * jnp.uint32(u.total)
                    valid = valid[None] & (lid >= 0)
                rows.append(checksum.sums_with(xs, checksum.weights(g, valid)))
            return jnp.concatenate(rows)
        specs = [codec.storage_spec(codec.unit(unit)) for unit, _ in order for _ in groups[unit, _]]
        arrays = [x for k in order for _, x in groups[k]]

        def local(*blocks):
            it, sums = iter(blocks), []
            for unit, tier in order:
                u = codec.unit(unit)
                xs = [next(it) for _ in groups[unit, tier]]
                b = len(u.batch_shape)
                spec = codec.storage_spec(u)
                used = {a for e in spec for a in checksum._axes_of(e)}
                r, R = checksum._axes_index(mesh, [a for a in mesh.axis_names if a not in used])
                rank = jax.lax.axis_index(DATA)
                row = jax.lax.axis_index(TENSOR) if u.tensor_sharded else 0
                stage = jax.lax.axis_index(codec.layer_axis) if b and codec.layer_axis else 0
                flat = [x.reshape(-1, x.shape[-1]) for x in xs]
                ident = codec.storage_identity(
                    u, tier, rank, row, self._layer_lookup(u, b, stage, flat[0].shape[0]))
                if R == 1:
                    sums.append(checksum.tile_sums(flat, ident))
                else:
                    n = flat[0].size
                    c = -(-n // R)
                    sums.append(checksum.tile_sums(flat, ident, r * jnp.uint32(c), c, n))
            return jax.lax.psum(jnp.concatenate(sums), tuple(mesh.axis_names))

        return jax.shard_map(
            local, mesh=mesh, in_specs=tuple(specs), out_specs=PartitionSpec(), check_vma=False
        )(*arrays)

    def _layer_lookup(self, u, batch: int, stage, local: int | None = None):
        """rows -> layer ids (int32) of a stacked unit's storage rows on this device (the
        stage's slots on a pipeline); None for a unit without layers."""
        if not batch:
            return None
        ids = jnp.asarray(np.asarray(self.codec.stacked_layer_ids(u), np.int32))
        if self.codec.layer_axis is None:
            return lambda rows: ids[rows]
        per = local if local is not None else len(self.codec.stacked_layer_ids(u))
        return lambda rows: ids[jnp.uint32(stage) * jnp.uint32(per) + rows]

    def stacked_checksums(self, state: TrainState, mesh: Mesh | None = None) -> jax.Array:
        """Traceable: `checksums` as one uint32[n, 2] array, rows in `checksum_keys` order."""
        return checksum.stack(self.checksums(state, mesh))

    def _slot_checksums(self, xs: list[jax.Array]) -> jax.Array:
        """uint32[n, 2]: the checksum of each slot leaf [S, Lmax, *rest] with the element
        identities of the canonical leaf [L, *rest] (layer-major), so it equals the unpipelined
        state's checksum; leaves of one shape share their identities (one pass)."""
        table = jnp.asarray(self.stage_layout.slot_layer())
        groups = checksum.same_shape_groups(xs)
        sums = []
        for group in groups:
            shape = xs[group[0]].shape
            rest = int(np.prod(shape[2:])) if len(shape) > 2 else 1
            lid = jnp.broadcast_to(table.reshape(table.shape + (1,) * (len(shape) - 2)), shape)
            r = jax.lax.broadcasted_iota(jnp.uint32, (1, 1, rest), 2).reshape((1, 1) + shape[2:])
            w = checksum.weights(lid.astype(jnp.uint32) * jnp.uint32(rest) + r, lid >= 0)
            sums.append(checksum.sums_with([xs[i] for i in group], w))
        return checksum.in_order(groups, sums)

    # -- deterministic mode ----------------------------------------------------------------------

    def summed_in_storage(self) -> frozenset[str]:
        """Leaves whose deterministic gradient can stay in the ZeRO storage's chunks after the
        tree sum (`treesum.TreeSum.finish`, `step._deterministic_grad_fn`): ZeRO-1 and -2 off
        pipelines, a leaf whose storage is its row cut in `data` equal parts
        (`ZeroCodec.whole_tier_paths`) and whose part holds whole tiles of `fixed_order_norm`
        (so the norm sums the same tiles as from the whole leaf)."""
        if self.codec is None or self.stage not in (1, 2) or self.stage_layout is not None:
            return frozenset()
        out = set()
        for path in self.codec.whole_tier_paths:
            u = self.codec.unit(path)
            width = u.row_len // self.codec.layout.data
            if width % _tile(u.row_len, u.members[0].shape, _layered(path)) == 0:
                out.add(path)
        return frozenset(out)

    def fixed_order_norm(self, params: PyTree, mesh: Mesh | None = None,
                         specs: PyTree | None = None, step: jax.Array | None = None,
                         chunked: frozenset[str] = frozenset()) -> jax.Array:
        """Global L2 norm of a params-shaped tree, reduced in an order that does not depend on
        the plan: a sum of squares per layer (stacked `[L, ...]` and slot `[S, Lmax, ...]`
        leaves alike) or per leaf, added one after another in canonical leaf and layer order.

        Given the `mesh`, the leaves' `specs` (an unpipelined plan: the deterministic gradient
        in parameter form, replicated over the data axis) and the `step` count, each device
        reduces its own block and a `psum` over the axes a leaf is sharded on (tensor, of a
        fixed degree) completes it: every sum is over the same elements on every plan. A
        device's block, flattened, is cut in tiles of `_tile` elements (a power of two, whole
        tiles per layer); each tile is summed in a balanced binary tree of additions
        (`_pairwise`), and so are a layer's tile sums. The leaves named in `chunked` come as
        their ZeRO storage tier instead (`summed_in_storage`: replica r holds elements [r * c,
        (r + 1) * c) of the block, whole tiles): each replica sums its own tiles and one small
        `all_gather` over `data` puts the tile sums together, the same numbers the whole block
        gives, whatever the replica count (tests/test_deterministic_zero.py,
        tests/test_treesum.py::test_the_norm_of_chunks_is_the_norm_of_the_whole_leaf).

        Every addition is spelled out because XLA:CPU's own reduce is not a fixed order: the
        sums of the rows of a `[k, 256]` array came out different for different k (28 of 64
        tile sums of a 16384-element leaf between the whole leaf and its eighths), so a
        replica's chunk and the whole leaf gave norms 1 ulp apart, and with it every clipped
        step after a shrink (experiments/RESULTS.md, "The norm's tiles and XLA's reduce"). The
        squares are made in a branch of their own, apart from the additions: fused with them,
        XLA:CPU contracted a multiply and an add into one FMA for some shapes and not for
        others.

        Left to GSPMD, the sums were split over sub-groups of the data axis (pairs and quads
        of replicas): partial sums that depend on the replica count (so did every clipped
        gradient), and gloo communicators among some survivors of a failure, which oblige the
        launch runtime to renew its CPU client (`runtime.collectives`). The squares are made in a
        conditional's branch (its predicate, `step >= 0`, never false but unknown to the
        compiler), compiled on its own: fused with the gradient's producers, the same sums over
        the same elements came out 1 ulp apart on 6 and 8 replicas where the norm also fed the
        clipping (tests/test_bitwise_sweep.py, the ZeRO demo's chain, clipped at every step;
        `step._apply_apart` says the same of the optimizer)."""
        if mesh is None or specs is None or step is None or self.stage_layout is not None:
            return self._norm_of(params)
        leaves, treedef = jax.tree.flatten(params)
        spec_leaves = treedef.flatten_up_to(specs)
        paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        layered = [_layered(path) for path in paths]
        for path, lay, spec in zip(paths, layered, spec_leaves):
            if lay and len(spec) and spec[0] is not None:
                raise ValueError(
                    f"fixed_order_norm: {path} is sharded on its layer axis ({spec}); "
                    "expected the parameter form of an unpipelined plan")
        # (layers, tile) per leaf, from its whole block: a chunked leaf's is its storage row
        shapes = []
        for path, lay, x, spec in zip(paths, layered, leaves, spec_leaves):
            if path in chunked:
                u = self.codec.unit(path)
                n, full = u.row_len, u.members[0].shape
            else:
                full = x.shape
                n = int(np.prod([s // _degree(mesh, e) for s, e in
                                 zip(full, tuple(spec) + (None,) * len(full))]))
            shapes.append((full[0] if lay else 1, _tile(n, full, lay)))
        in_specs = [treesum.chunk_spec(s) if p in chunked else s
                    for p, s in zip(paths, spec_leaves)]

        def squares(blocks):
            return tuple(jnp.square(g.astype(jnp.float32)) for g in blocks)

        def local(n, *blocks):
            sq = jax.lax.cond(
                n >= 0, squares,
                lambda bs: tuple(jnp.zeros(p.shape, p.dtype)
                                 for p in jax.eval_shape(squares, bs)),
                blocks)
            sums = [_pairwise(s.reshape(-1, t)) for s, (_, t) in zip(sq, shapes)]
            at = [i for i, p in enumerate(paths) if p in chunked]
            if at and mesh.shape[DATA] > 1:  # each replica's tiles, in rank order
                got = all_gather_packed([sums[i][None] for i in at], DATA, [0] * len(at))
                for i, g in zip(at, got):
                    sums[i] = g.reshape(-1)
            out = []
            for s, (layers, _), spec in zip(sums, shapes, spec_leaves):
                part = _pairwise(s.reshape(layers, -1))
                axes = tuple(a for e in spec for a in checksum._axes_of(e) if mesh.shape[a] > 1)
                out.append(jax.lax.psum(part, axes) if axes else part)
            return self._ordered_root(jnp.concatenate(out))

        return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), *in_specs),
                             out_specs=PartitionSpec(), check_vma=False)(step, *leaves)

    def _norm_of(self, params: PyTree) -> jax.Array:
        """`fixed_order_norm` of a whole tree, reductions left to GSPMD (pipelines, no mesh)."""
        parts = []
        slots = self.stage_layout
        for path, g in jax.tree_util.tree_flatten_with_path(params)[0]:
            lay = _layered(path_str(path))
            if slots is None or not lay:
                parts.append(_square_sums(g, lay))
            else:
                sq = jnp.square(g.astype(jnp.float32))
                per_slot = jnp.sum(sq, axis=tuple(range(2, g.ndim))).reshape(-1)
                parts.append(jnp.take(per_slot, jnp.asarray(slots.layer_flat_slot())))
        return self._ordered_root(jnp.concatenate(parts))

    @staticmethod
    def _ordered_root(v: jax.Array) -> jax.Array:
        """sqrt of `v`'s elements added one after another, first to last."""
        total, _ = jax.lax.scan(lambda acc, x: (acc + x, None), jnp.zeros((), v.dtype), v)
        return jnp.sqrt(total)


def _layered(path: str) -> bool:
    """Is the parameter at `path` stacked over layers (`[L, ...]`)?"""
    return "layers" in path.split("/")


TILE = 1 << 8  # elements per tile of `fixed_order_norm` at most


def _tile(n: int, shape: tuple[int, ...], layered: bool) -> int:
    """`fixed_order_norm`'s tile for a block of `n` elements of a leaf of `shape`: the largest
    power of two up to `TILE` that divides a layer's part of the block (the block's, unstacked)."""
    return math.gcd(n // shape[0] if layered else n, TILE)


def _degree(mesh: Mesh, entry) -> int:
    """Devices a dimension is split over by a PartitionSpec `entry`."""
    return int(np.prod([mesh.shape[a] for a in checksum._axes_of(entry)])) if entry else 1


def _pairwise(v: jax.Array) -> jax.Array:
    """[..., m] -> [...]: the last axis summed in a balanced binary tree (padded with zeros to a
    power of two, each level the first half plus the second): additions in a fixed order."""
    m = v.shape[-1]
    p = 1 << max(0, m - 1).bit_length()
    v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, p - m)])
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return v[..., 0]


def _square_sums(g: jax.Array, layered: bool) -> jax.Array:
    """float32 sums of `g`'s squares: one per layer of a stacked leaf, else one ([1])."""
    sq = jnp.square(g.astype(jnp.float32))
    return jnp.sum(sq, axis=tuple(range(1, g.ndim))) if layered else jnp.sum(sq)[None]


class OptimizerMeaningError(ValueError):
    """An optimizer whose updates change when it sees ZeRO storage instead of parameters."""


def check_elementwise(factory: StateFactory, plan, *, steps: int = 2, seed: int = 0) -> None:
    """Refuse an optimizer that ZeRO storage would change the meaning of.

    Under elasjax's ZeRO storage (`zero.stage` >= 1) the optimizer updates storage units (flat
    partitions of the parameters) instead of the parameters themselves. That is right for
    elementwise transforms (Adam, SGD, weight decay) and for global ones whose value does not
    depend on shapes (global-norm clipping), and wrong for factored or per-leaf ones (Adafactor,
    LAMB's trust ratio, a mask by path or shape). This runs `steps` updates of random gradients
    both ways, on one device, and compares them (rtol 1e-5). An optimizer state with a
    parameter-structured part of other shapes (Adafactor's factored statistics) is refused
    before that."""
    fix = (
        "Fixes: zero.stage = 0, or an elementwise optimizer (adam, sgd, ...), or keep your loop "
        "and shard the optimizer state with elasjax.zero_shardings(1, ...) (ZeRO-1 as a sharding "
        "edit, which keeps the parameter structure)"
    )
    like = jax.tree_util.tree_structure(factory.abstract.params)
    shapes = [x.shape for x in jax.tree.leaves(factory.abstract.params)]
    for sub in jax.tree.leaves(
        factory.abstract.opt_state, is_leaf=lambda t: jax.tree_util.tree_structure(t) == like
    ):
        if jax.tree_util.tree_structure(sub) == like and [x.shape for x in jax.tree.leaves(sub)] != shapes:
            raise OptimizerMeaningError(
                f"the optimizer is not elementwise: its state holds parameter-structured "
                f"statistics of other shapes (e.g. {jax.tree.leaves(sub)[0].shape} for a "
                f"parameter of shape {shapes[0]}), which ZeRO storage (zero.stage = "
                f"{plan.zero_stage}) cannot partition like the parameters. {fix}"
            )
    layout = factory.layout(plan)
    abstract = factory.abstract.params
    keys = jax.random.split(jax.random.key(seed), 2 * steps + 1)
    leaves, treedef = jax.tree.flatten(abstract)
    rand = lambda k: jax.tree.unflatten(treedef, [  # noqa: E731
        0.02 * jax.random.normal(kk, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else jnp.zeros(x.shape, x.dtype)
        for kk, x in zip(jax.random.split(k, len(leaves)), leaves)
    ])
    tx = layout.tx

    @jax.jit
    def both(params, grads_list):
        p, o = params, tx.init(params)
        sp = layout.to_storage(params)
        so = tx.init(sp)
        for g in grads_list:
            u, o = tx.update(g, o, p)
            p = optax.apply_updates(p, u)
            su, so = tx.update(layout.to_storage(g), so, sp)
            sp = optax.apply_updates(sp, su)
        return p, layout.from_storage(sp)

    ref, got = both(rand(keys[0]), [rand(k) for k in keys[1 : 1 + steps]])
    bad = [
        path_str(path)
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(got))
        if not np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    ]
    if bad:
        raise OptimizerMeaningError(
            f"the optimizer is not elementwise: on zero.stage = {layout.stage} storage its updates "
            f"differ from those on the parameters (e.g. '{bad[0]}', {len(bad)} leaves). {fix}"
        )

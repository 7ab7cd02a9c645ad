"""Decoder-only GPT in Flax (linen) with layout-independent dropout.

Parameters carry logical axis names (`nn.with_logical_partitioning`), read once with
`logical_specs`; the training code only sees the plain parameter pytree. Layers are stacked on a
leading `layers` axis (`nn.scan`) so a stage split is a slice of that axis.

Dropout is keyed per sample, not per batch: the caller passes one key per sample (derived from
the step and the sample's global id, see `elasjax.core.rng`), and each dropout site folds in its
layer id and site id. A sample therefore draws the same mask whichever device, replica, micro-batch or
slot runs it, which is what makes a re-planned run compute the fault-free run's function.
Flax's own `nn.Dropout` draws one mask for the whole (sharded) batch from one key, so a sample's
mask would depend on its position in the batch; it is not used.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from ..config import ModelConfig, allowed_tensor_degrees
from ..core.modelspec import LayerStack, ModelSpec
from .costmodel import ModelProfile
from .text_data import make_source

INIT_STD = 0.02
EMBED_DROPOUT_LAYER = 0xFFFF  # layer id of the embedding dropout site (no real layer has it)
# `model.remat: dots` keeps the matrix products' outputs and the dropout masks: recomputed, a
# mask is its samples' threefry hashes again (experiments/RESULTS.md, "The dropout masks kept")
DROPOUT_MASK = "dropout_mask"
REMAT_POLICY = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.save_only_these_names(DROPOUT_MASK))


def _init(axes, std=INIT_STD):
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def _zeros(axes):
    return nn.with_logical_partitioning(nn.initializers.zeros, axes)


def _ones(axes):
    return nn.with_logical_partitioning(nn.initializers.ones, axes)


def sample_dropout(x, rate: float, keys, layer_id, site: int, deterministic: bool):
    """Inverted dropout with one key per sample. `x`: [batch, ...]; `keys`: typed keys [batch]."""
    if deterministic or rate == 0.0:
        return x
    keep = 1.0 - rate

    def one(key, xi):
        key = jax.random.fold_in(jax.random.fold_in(key, layer_id), site)
        mask = checkpoint_name(jax.random.bernoulli(key, keep, xi.shape), DROPOUT_MASK)
        return jnp.where(mask, xi / keep, jnp.zeros_like(xi))

    return jax.vmap(one)(keys, x)


def _layer_norm(name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=1e-5, name=name, scale_init=_ones(("norm",)), bias_init=_zeros(("norm",))
    )


class Block(nn.Module):
    """Pre-norm transformer block. Called as (carry, per-layer input) by `nn.scan`."""

    cfg: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, keys, layer_id):
        c = self.cfg
        B, T, _ = x.shape
        h = _layer_norm("ln1")(x)
        qkv = nn.DenseGeneral(
            (3, c.n_heads, c.head_dim),
            name="qkv",
            use_bias=False,
            kernel_init=_init(("embed", None, "heads", "head_dim")),
        )(h)
        # Biases for queries and values only: a key bias adds the same score to every key of a
        # query, which softmax cancels, so its true gradient is exactly zero and Adam would turn
        # its round-off noise into lr-sized random updates that differ between layouts.
        qv_bias = self.param(
            "qv_bias", _zeros((None, "heads", "head_dim")), (2, c.n_heads, c.head_dim)
        )
        q = qkv[:, :, 0] + qv_bias[0]
        k = qkv[:, :, 1]
        v = qkv[:, :, 2] + qv_bias[1]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(c.head_dim).astype(x.dtype)
        causal = jnp.tril(jnp.ones((T, T), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        att = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        att = nn.DenseGeneral(
            c.d_model,
            axis=(-2, -1),
            name="attn_out",
            kernel_init=_init(("heads", "head_dim", "embed"), INIT_STD / (2 * c.n_layers) ** 0.5),
            bias_init=_zeros(("embed",)),
        )(att)
        x = x + sample_dropout(att, c.dropout, keys, layer_id, 0, self.deterministic)
        h = _layer_norm("ln2")(x)
        h = nn.Dense(
            c.d_mlp, name="mlp_in", kernel_init=_init(("embed", "mlp")), bias_init=_zeros(("mlp",))
        )(h)
        h = nn.gelu(h)
        h = nn.Dense(
            c.d_model,
            name="mlp_out",
            kernel_init=_init(("mlp", "embed"), INIT_STD / (2 * c.n_layers) ** 0.5),
            bias_init=_zeros(("embed",)),
        )(h)
        x = x + sample_dropout(h, c.dropout, keys, layer_id, 1, self.deterministic)
        return x, None


class GPT(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, keys, deterministic: bool = True):
        """tokens: int32 [batch, seq]; keys: typed PRNG keys [batch]. Returns f32 logits."""
        c = self.cfg
        T = tokens.shape[1]
        embed = nn.Embed(
            c.vocab_size, c.d_model, name="embed", embedding_init=_init(("vocab", "embed"))
        )
        pos = self.param("pos_embed", _init(("sequence", "embed")), (c.seq_len, c.d_model))
        x = embed(tokens) + pos[None, :T]
        x = sample_dropout(x, c.dropout, keys, EMBED_DROPOUT_LAYER, 0, deterministic)
        layers = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, 0),
            length=c.n_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(c, deterministic, name="layers")
        x, _ = layers(x, keys, jnp.arange(c.n_layers))
        x = _layer_norm("ln_f")(x)
        if c.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(
                c.vocab_size, name="head", kernel_init=_init(("embed", "vocab")),
                bias_init=_zeros(("vocab",)),
            )(x)
        return logits.astype(jnp.float32)


def build(cfg: ModelConfig) -> GPT:
    return GPT(cfg)


def init_params(cfg: ModelConfig, key: jax.Array):
    """Plain (unboxed) parameter pytree."""
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    keys = jax.random.split(key, 1)
    variables = build(cfg).init({"params": key}, tokens, keys, True)
    return nn.unbox(variables["params"])


def logical_specs(cfg: ModelConfig):
    """Pytree (matching `init_params`) of logical-axis PartitionSpecs."""
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)

    def init(key):
        keys = jax.random.split(key, 1)
        return build(cfg).init({"params": key}, jnp.zeros(tokens.shape, tokens.dtype), keys, True)

    boxed = jax.eval_shape(init, jax.random.key(0))
    return nn.get_partition_spec(boxed)["params"]


def embed_apply(params, tokens, keys, cfg: ModelConfig, deterministic: bool):
    """Token + position embedding and its dropout: [batch, seq] -> [batch, seq, d_model]."""
    x = jnp.take(params["embed"]["embedding"], tokens, axis=0)
    x = x + params["pos_embed"][None, : tokens.shape[1]]
    return sample_dropout(x, cfg.dropout, keys, EMBED_DROPOUT_LAYER, 0, deterministic)


def block_apply(layer_params, x, keys, layer_id, cfg: ModelConfig, deterministic: bool):
    """One transformer block with one layer's (unstacked) parameters."""
    return Block(cfg, deterministic).apply({"params": layer_params}, x, keys, layer_id)[0]


def head_apply(params, x, cfg: ModelConfig):
    """Final norm and the LM head: f32 logits."""
    x = nn.LayerNorm(epsilon=1e-5).apply({"params": params["ln_f"]}, x)
    if cfg.tie_embeddings:
        logits = x @ params["embed"]["embedding"].T
    else:
        logits = nn.Dense(cfg.vocab_size).apply({"params": params["head"]}, x)
    return logits.astype(jnp.float32)


def forward(params, tokens, keys, cfg: ModelConfig, deterministic: bool, layer_transform=None):
    """The GPT as explicit pieces (embed -> scan over layers -> head); equal to `GPT.apply`.

    `layer_transform(layer_params)` runs inside the layer loop on each layer's stored parameters
    before use: ZeRO-3 gathers a layer's partitions there, so only one layer is materialised at a
    time. With `cfg.remat` "dots" the loop's body is rematerialised but for its matrix products
    and dropout masks (`ModelConfig.remat`, `REMAT_POLICY`; ZeRO-3's gather of a layer is then
    made again in the backward pass); "auto" must be resolved before (`Config.model_in_force`).
    """
    if cfg.remat not in ("dots", "none"):
        raise ValueError(f"model.remat = {cfg.remat!r} here: resolve it first "
                         "(`Config.model_in_force`); allowed values: 'dots', 'none'")
    x = embed_apply(params, tokens, keys, cfg, deterministic)

    def body(x, inp):
        lp, lid = inp
        if layer_transform is not None:
            lp = layer_transform(lp)
        return block_apply(lp, x, keys, lid, cfg, deterministic), None

    if cfg.remat == "dots":  # see `ModelConfig.remat`
        body = jax.checkpoint(body, policy=REMAT_POLICY)
    x, _ = jax.lax.scan(body, x, (params["layers"], jnp.arange(cfg.n_layers)))
    return head_apply(params, x, cfg)


def token_losses(
    params, cfg: ModelConfig, inputs, targets, keys, deterministic: bool, layer_transform=None
):
    """Per-token cross-entropy, f32 [batch, seq]."""
    logits = forward(params, inputs, keys, cfg, deterministic, layer_transform)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def spec(cfg: ModelConfig) -> ModelSpec:
    """elasjax's GPT as a `ModelSpec` (cached per config): token windows, a per-token loss
    normalised by the step's tokens, a layer stack (pipelines, ZeRO-3 layer gathers)."""
    return _spec(cfg)


@functools.lru_cache(maxsize=16)
def _spec(cfg: ModelConfig) -> ModelSpec:
    def loss(params, batch, keys, weights, deterministic, layer_transform=None):
        tl = token_losses(
            params, cfg, batch["inputs"], batch["targets"], keys, deterministic, layer_transform
        )
        return jnp.sum(tl * weights[:, None])

    window = jax.ShapeDtypeStruct((cfg.seq_len,), jnp.int32)
    return ModelSpec(
        name="gpt",
        init_params=functools.partial(init_params, cfg),
        logical_specs=functools.partial(logical_specs, cfg),
        loss=loss,
        example_shapes={"inputs": window, "targets": window},
        data=lambda data_cfg: make_source(data_cfg, cfg),
        count=lambda ex: np.full(len(ex["inputs"]), cfg.seq_len, np.float32),
        tensor_degrees=tuple(allowed_tensor_degrees(cfg)),
        profile=ModelProfile.from_gpt(cfg),
        layers=LayerStack(
            embed=lambda p, batch, keys, det: embed_apply(p, batch["inputs"], keys, cfg, det),
            block=lambda lp, x, keys, lid, det: block_apply(lp, x, keys, lid, cfg, det),
            head_loss=functools.partial(_head_loss, cfg),
            activation_shape=(cfg.seq_len, cfg.d_model),
        ),
        n_layers=cfg.n_layers,
    )


def _head_loss(cfg: ModelConfig, params, x, batch, weights):
    tl = optax.softmax_cross_entropy_with_integer_labels(head_apply(params, x, cfg), batch["targets"])
    return jnp.sum(tl * weights[:, None])

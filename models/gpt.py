"""A Llama-style decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The file imports no distributed, compile or kernel code. Parallelism is applied to a finished
model from outside (graphtrain.parallel), speed comes from the compiler's graph passes
(graphtrain.passes), so what is written here is the obvious code.

Packed sequences: a row holds several documents. `position_ids` restart at each document (RoPE
is indexed by them), and `attn_mask` keeps attention inside each document. The mask is built
outside the model (graphtrain.attention) and is one of:
  * None: plain causal attention over the whole row;
  * a bool Tensor (B, 1, T, T), True where a query may attend to a key: SDPA, works everywhere;
  * a FlexAttention BlockMask: the fast GPU path (sparse blocks skipped; see graphtrain.attention);
  * DocumentSpans: the documents' offsets in the flattened batch, for torch's varlen attention
    (FlashAttention-2's variable-length kernel on CUDA).

Parameter names follow Llama (tok_embeddings, layers.N.attention.wq, feed_forward.w1, norm,
output); RoPE uses the rotate-half layout of Hugging Face's Llama, so export is a renaming.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from models.fields import option
from models.layers import RMSNorm, init_trunc_normal
from models.mtp import IGNORE_INDEX, MTPLayer, mtp_shift


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = option(8192, "embedding and output rows (>= the tokenizer's vocabulary)")
    dim: int = option(256, "model width")
    num_layers: int = option(4, "transformer blocks")
    num_heads: int = option(4, "attention (query) heads; head_dim = dim / num_heads")
    num_kv_heads: int = option(4, "key/value heads (grouped-query attention; divides num_heads)")
    ffn_dim: int = option(768, "hidden width of the SwiGLU feed-forward network")
    max_seq_len: int = option(2048, "longest sequence the RoPE tables cover")
    rope_theta: float = option(10000.0, "RoPE base frequency")
    norm_eps: float = option(1e-5, "RMSNorm epsilon")
    tie_embeddings: bool = option(False, "the output head shares the token embedding's weight")
    init_std: float = option(0.02, "standard deviation of the normal weight initialization")
    mtp_depth: int = option(0, "D multi-token prediction depths (models/mtp.py); 0: off")
    mtp_loss_scale: float = option(
        0.1, "lambda: loss = main + lambda / D * sum of the depths' losses"
    )

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise ValueError(
                f"model.dim={self.dim} is not divisible by model.num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not divisible by "
                f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.max_seq_len < 2:
            raise ValueError(f"model.max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.mtp_depth < 0:
            raise ValueError(
                f"model.mtp_depth must be >= 0 (0 turns MTP off), got {self.mtp_depth}"
            )
        if self.mtp_loss_scale < 0:
            raise ValueError(f"model.mtp_loss_scale must be >= 0, got {self.mtp_loss_scale}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_dim(self) -> int:
        """The width of each head RoPE rotates (models.hybrid may rotate part of it)."""
        return self.head_dim


C = TypeVar("C", bound=GPTConfig)


def derive(base: GPTConfig, cls: type[C], **changes: Any) -> C:
    """A preset of config class `cls` (base's class or a subclass) that builds on `base`: its
    values, changed by `changes`."""
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return cls(**(values | changes))


# Llama-3-8B's shape.
_LLAMA3_8B = GPTConfig(
    vocab_size=128256,
    dim=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    ffn_dim=14336,
    max_seq_len=8192,
    rope_theta=500000.0,
)

PRESETS: dict[str, GPTConfig] = {
    # About 7.3M parameters: learns the default corpus on a 2-core CPU within minutes.
    "tiny": GPTConfig(
        vocab_size=8192,
        dim=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=768,
        max_seq_len=1024,
    ),
    # Small enough for fast tests, with every feature (GQA, untied head) exercised.
    "debug": GPTConfig(
        vocab_size=512,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=160,
        max_seq_len=256,
    ),
    "125m": GPTConfig(
        vocab_size=32768,
        dim=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        ffn_dim=2048,
        max_seq_len=2048,
        tie_embeddings=True,
    ),
    # The end-to-end benchmark shape (benchmarks/e2e.py, dense 1b).
    "1b": GPTConfig(
        vocab_size=128256,
        dim=2048,
        num_layers=16,
        num_heads=16,
        num_kv_heads=8,
        ffn_dim=8192,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
    # The one-GPU FP8 benchmark shape (benchmarks/e2e.py --fp8): Llama-3-8B's block (dim 4096,
    # 32 heads of 128, 8 kv heads, SwiGLU 14336) 10 times, untied vocabulary 128256.
    # 3,231,797,248 parameters: 10 x 218,112,000 per block (attention 41,943,040, FFN
    # 176,160,768, norms 8,192) + 2 x 525,336,576 (embedding, head) + 4,096 (final norm).
    # fp32 master weights, gradients and AdamW moments, 16 bytes a parameter: 48.2 GiB. At
    # 1 x 4096 tokens `graphtrain plan --preset 3b` adds 6.7 GiB of activations and 2.3 GiB of
    # loss buffers (57.2 GiB), and autocast's bf16 weight copies kept for the backward 6.0 GiB
    # more: about 63 GiB, inside an 80 GB H100 (micro-batch 2: about 70 GiB). 8b does not fit.
    "3b": derive(_LLAMA3_8B, GPTConfig, num_layers=10, max_seq_len=4096),
    "8b": _LLAMA3_8B,
}


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """cos and sin of every (position, frequency): (max_seq_len, head_dim // 2, 2), fp32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: (B, T, H, D); rope: (B, T, D // 2, 2) gathered at the positions."""
    cos = rope[..., 0].unsqueeze(2)  # (B, T, 1, D/2)
    sin = rope[..., 1].unsqueeze(2)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.type_as(x)


class DocumentSpans(NamedTuple):
    """The documents of a packed (B, T) batch as varlen attention takes them: `cu_seqlens`
    (int32) holds where each document starts in the B * T flattened tokens, then B * T (a row
    boundary also starts one); `max_len` bounds a document's length. Built by
    graphtrain.attention.document_spans."""

    cu_seqlens: torch.Tensor
    max_len: int


# What attention takes besides q, k, v (see the module's docstring).
AttnMask = torch.Tensor | BlockMask | DocumentSpans | None


def _varlen_attn() -> tuple[Any, bool]:
    """torch's varlen_attn, and whether it has enable_gqa (torch 2.13 added it and refuses fewer
    key heads without it; 2.11's kernel takes them as they are). Imported at first use: the
    module imports torch._dynamo, which importing the models must not (graphtrain registers its
    backend then, and that imports the models)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: AttnMask) -> torch.Tensor:
    """Causal grouped-query attention: q (B, T, H, D), k and v (B, T, Hkv, D) -> (B, T, H * D).
    attn_mask: None (causal), a bool (B, 1, T, T) mask (SDPA), a BlockMask (FlexAttention) or
    DocumentSpans (varlen attention)."""
    B, T = q.shape[:2]
    if isinstance(attn_mask, DocumentSpans):
        cu, n = attn_mask
        varlen_attn, has_gqa = _varlen_attn()
        gqa = {"enable_gqa": True} if has_gqa and k.shape[2] != q.shape[2] else {}
        # (B * T, heads, D): views of the projections; window (-1, 0) is causal in each span
        out = varlen_attn(
            *(t.reshape(B * T, -1, t.shape[-1]) for t in (q, k, v)), cu, cu, n, n,
            window_size=(-1, 0), **gqa,
        )  # fmt: skip
        return out.view(B, T, -1)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    if isinstance(attn_mask, BlockMask):
        out = flex_attention(q, k, v, block_mask=attn_mask, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, enable_gqa=True
        )
    return out.transpose(1, 2).reshape(B, T, -1)  # (B, T, H * D)


class Attention(nn.Module):
    # wq's rows per head, in units of head_dim: the query (models.hybrid.GatedAttention: and
    # its gate).
    query_parts = 1

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, self.query_parts * cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, attn_mask: AttnMask) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        return self.wo(attend(q, k, v, attn_mask))

    def init_weights(self, std: float, out_std: float) -> None:
        init_trunc_normal(std, self.wq.weight, self.wk.weight, self.wv.weight)
        init_trunc_normal(out_std, self.wo.weight)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        init_trunc_normal(std, self.w1.weight, self.w3.weight)
        init_trunc_normal(out_std, self.w2.weight)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: a token mixer (attention here), then a position-wise network.
    Subclasses swap either through build_mixer and build_ffn (models.moe, models.hybrid); the
    norms keep their names whatever the mixer."""

    # Whether the mixer reads the packed row's document_ids (models.hybrid's recurrent blocks)
    # instead of (rope, attn_mask); GPT.block_inputs passes them to such a block.
    reads_documents = False

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.build_mixer(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.build_ffn(cfg)

    def build_mixer(self, cfg: GPTConfig) -> None:
        """Registers the token mixer that follows attention_norm (models.hybrid's Gated DeltaNet
        block registers `linear_attention` instead)."""
        self.attention = Attention(cfg)

    @property
    def mixer(self) -> nn.Module:
        return self.attention

    def build_ffn(self, cfg: GPTConfig) -> None:
        """Registers the position-wise network that follows ffn_norm (models.moe.MoEBlock
        registers an MoE layer named `moe` instead)."""
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    @property
    def ffn(self) -> nn.Module:
        return self.feed_forward

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        attn_mask: AttnMask,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        context = (document_ids,) if self.reads_documents else (rope, attn_mask)
        h = x + self.mixer(self.attention_norm(x), *context)
        return h + self.ffn(self.ffn_norm(h))

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.mixer.init_weights(std, out_std)
        self.ffn.init_weights(std, out_std)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0".."L-1" keeps Llama's names and lets layers be replaced
        # (compiled, checkpointed, or removed by pipeline stages) without renumbering.
        self.layers = nn.ModuleDict({str(i): self.build_block(i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Registered last, so a model without MTP has exactly the parameters (and the init
        # draws) it had before MTP existed.
        if cfg.mtp_depth:
            self.mtp_layers = nn.ModuleDict(
                {str(k): self.build_mtp_layer() for k in range(cfg.mtp_depth)}
            )
        # Recomputed by init_weights, never saved: a function of the config alone.
        self.register_buffer(
            "rope", rope_cache(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False
        )

    def build_block(self, layer_id: int) -> nn.Module:
        """Block number layer_id (models.moe.MoEGPT builds MoE blocks after the dense ones)."""
        return TransformerBlock(self.cfg)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block layer_id has an MoE feed-forward network (models.moe.MoEGPT)."""
        return False

    def block_inputs(
        self,
        layer: nn.Module,
        rope: torch.Tensor,
        attn_mask: AttnMask,
        document_ids: torch.Tensor | None,
    ) -> tuple:
        """The inputs after the hidden state that `layer` of the trunk takes: (rope, attn_mask),
        and document_ids for a block that reads them (models.hybrid's recurrent blocks)."""
        return (rope, attn_mask, document_ids) if layer.reads_documents else (rope, attn_mask)

    def build_mtp_layer(self) -> MTPLayer:
        """One MTP depth: the norms, and the block of build_mtp_block."""
        cfg = self.cfg
        return MTPLayer(
            RMSNorm(cfg.dim, cfg.norm_eps),
            RMSNorm(cfg.dim, cfg.norm_eps),
            cfg.dim,
            self.build_mtp_block(),
        )

    def build_mtp_block(self) -> nn.Module:
        """The block of an MTP depth: of the kind of the trunk's last layer."""
        return self.build_block(self.cfg.num_layers - 1)

    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter and buffer in place (after to_empty from the meta device).

        std for inputs of each block, std / sqrt(2 * num_layers) for the projections that write
        into the residual stream (GPT-2 / Megatron scaling), so the residual variance stays flat.
        """
        cfg = self.cfg
        if cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # Module.to_empty from the meta device makes a new Parameter per module: re-tie.
            self.output.weight = self.tok_embeddings.weight
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            self.rope.copy_(
                rope_cache(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, self.rope.device)
            )
        std = cfg.init_std
        out_std = std / math.sqrt(2 * cfg.num_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=1.0 if not cfg.tie_embeddings else std)
        for layer in self.layers.values():
            layer.init_weights(std, out_std)
        self.norm.init_weights()
        if not cfg.tie_embeddings:
            init_trunc_normal(cfg.dim**-0.5, self.output.weight)
        for mtp_layer in self.mtp_layers.values() if cfg.mtp_depth else ():
            mtp_layer.init_weights(std, out_std)  # after the trunk: its draws stay the same

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attn_mask: AttnMask = None,
        document_ids: torch.Tensor | None = None,
        stats: Any = None,
    ) -> torch.Tensor:
        """input_ids, labels, position_ids: (B, T). Returns the mean loss over labels != -100
        (plus the MTP losses when cfg.mtp_depth > 0) when labels are given, else the main
        head's logits (B, T, V).

        document_ids (B, T): the document of each position in a packed row, which keeps the MTP
        shifts inside documents (None: each row is one document; the main loss ignores it).
        stats: what the forward fills with `stats[name] = detached device tensor` (a dict, or
        any object with item assignment: the trainer's is not a dict, which FSDP2 would copy),
        with MTP the main head's and each depth's loss and acceptance (`scored_head_loss`);
        None to compute nothing extra.
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        rope = self.rope[position_ids]  # (B, T, D/2, 2)
        h = self.tok_embeddings(input_ids)  # (B, T, dim)
        for layer in self.layers.values():
            h = layer(h, *self.block_inputs(layer, rope, attn_mask, document_ids))
        if labels is None:
            return self.output(self.norm(h))
        if not (self.cfg.mtp_depth and self.training):
            # MTP is a training objective: evaluation (validation, `graphtrain eval`) reports
            # the next-token loss alone, comparable across mtp_depth.
            return self.head_loss(h, labels)
        loss = self.scored_head_loss(h, labels, stats, depth=0)
        return loss + self.mtp_loss(h, input_ids, labels, rope, attn_mask, document_ids, stats)

    def mtp_loss(
        self,
        h: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        rope: torch.Tensor,
        attn_mask: AttnMask,
        document_ids: torch.Tensor | None,
        stats: Any,
    ) -> torch.Tensor:
        """(mtp_loss_scale / D) * sum over depths k of L_k, the mean cross-entropy of depth k's
        prediction of the token k + 1 ahead (models/mtp.py). h: the trunk's last hidden state.

        stats gets "mtp/loss_k" and "mtp/acceptance_k" of each depth (`scored_head_loss`).
        """
        total = torch.zeros((), device=h.device)
        for k, mtp_layer in enumerate(self.mtp_layers.values(), start=1):
            ids, labels_k, keep = mtp_shift(input_ids, labels, document_ids, k)
            h = mtp_layer(h, self.tok_embeddings(ids), keep, rope, attn_mask)
            total = total + self.scored_head_loss(h, labels_k, stats, depth=k)
        return total * (self.cfg.mtp_loss_scale / self.cfg.mtp_depth)

    def scored_head_loss(
        self, h: torch.Tensor, labels: torch.Tensor, stats: Any, depth: int
    ) -> torch.Tensor:
        """`head_loss` of a training step with MTP: depth 0 is the main head, k the MTP depth
        k's prediction of the token k + 1 ahead. Every head call of such a step (the main head's
        too) counts hits when `stats` is given, so the compiled head region is one graph, not
        two. stats gets "mtp/loss_{depth}" (depth 0: the next-token loss alone, comparable with
        a run without MTP, where "loss" adds the depths') and "mtp/acceptance_{depth}": the
        fraction of the counted positions (label not ignored) whose top-1 prediction is the
        true token."""
        if stats is None:
            return self.head_loss(h, labels)
        loss, hits = self.head_loss(h, labels, count_hits=True)
        counted = (labels != IGNORE_INDEX).sum().clamp(min=1)
        stats[f"mtp/loss_{depth}"] = loss.detach()
        stats[f"mtp/acceptance_{depth}"] = (hits / counted).detach()
        return loss

    def head_loss(
        self, h: torch.Tensor, labels: torch.Tensor, count_hits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final norm, output head and cross-entropy: one compile region of its own, so the
        linear -> cross_entropy pattern is visible to the fusion pass.

        count_hits: also return the number of positions whose top-1 (argmax) logit is the label
        (ignored labels, -100, never count). The fused cross-entropy counts these from its own
        row maxima, so compiled, the logits are still never materialised.
        """
        # Matched by the fuse_linear_cross_entropy pass (graphtrain/passes/linear_cross_entropy.py).
        logits = self.output(self.norm(h)).flatten(0, 1).float()  # (B * T, V)
        target = labels.flatten(0, 1)
        loss = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)
        if not count_hits:
            return loss
        # Folded into the fused op's top-1 count (passes/linear_cross_entropy_accuracy.py).
        return loss, (logits.argmax(-1) == target).sum()


def build_gpt(cfg: GPTConfig) -> GPT:
    return GPT(cfg)

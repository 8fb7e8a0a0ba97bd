"""The network, its pretraining loss and evaluation, and its export in Hugging Face's format."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import hsync
from apps.bert.config import ModelPreset, TrainConfig
from apps.bert.consensus import fail_together
from apps.bert.data import PretrainingExamples, Vocabulary, to_device
from apps.bert.interrupt import StopRequest

COMM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --comm-dtype: WeightedDDP's comm_dtype


def import_transformers() -> None:
    """Loads what this trainer uses of transformers: after the flags and the run's folder are checked (a
    bad one is refused in a second, not six), and before the work starts: transformers loads its model code
    lazily, at first use, which should not be rank 0's final save while its peers wait."""
    import transformers
    from transformers import BertConfig, BertForPreTraining, BertTokenizerFast  # noqa: F401 - loaded, used later

    transformers.utils.logging.disable_progress_bar()  # no bar per saved shard in the run's log


def build_model(preset: ModelPreset, vocab: Vocabulary, dropout: float) -> nn.Module:
    from transformers import BertConfig, BertForPreTraining

    config = BertConfig(vocab_size=vocab.size, hidden_size=preset.hidden_size, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout,
                        num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_heads,
                        intermediate_size=preset.intermediate_size, max_position_embeddings=preset.max_seq_len,
                        pad_token_id=vocab.pad, attn_implementation="sdpa")  # its mask: pretraining_logits
    return BertForPreTraining(config)


def wrap_model(net: nn.Module, cfg: TrainConfig) -> hsync.WeightedDDP:
    """The model in hsync's wrapper, as the flags set it, with the metrics train_micro_step reports."""
    return hsync.WeightedDDP(net, **wrap_options(cfg))


def wrap_options(cfg: TrainConfig) -> dict:
    """hsync.WeightedDDP's keyword arguments as the flags set them."""
    return dict(forward_sync_buffers=False, gradient_as_bucket_view=cfg.bucket_views,
                metric_names=("tokens", "examples", "mlm", "nsp", StopRequest.METRIC), timeout=collective_timeout(cfg),
                comm_dtype=COMM_DTYPES[cfg.comm_dtype])


def collective_timeout(cfg: TrainConfig) -> datetime.timedelta | None:
    """--collective-timeout as a deadline (None: hsync's default)."""
    return datetime.timedelta(seconds=cfg.collective_timeout) if cfg.collective_timeout else None


def pretraining_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked-LM logits of every position and the next-sentence logits, from bf16 autocast on a GPU.
    The padding mask goes in as torch's attention kernel (sdpa) takes it, boolean and 4-D: given in 2-D,
    transformers would check on the host whether it masks anything, a host sync per forward."""
    device = batch["input_ids"].device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                    attention_mask=batch["attention_mask"].bool()[:, None, None, :])
    return out.prediction_logits, out.seq_relationship_logits


def pretraining_losses(mlm_logits: torch.Tensor, nsp_logits: torch.Tensor,
                       batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed masked-LM loss over the masked tokens (the others' labels are -100) and the summed
    next-sentence loss, in float32."""
    mlm = nn.functional.cross_entropy(mlm_logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                      ignore_index=-100, reduction="sum")
    nsp = nn.functional.cross_entropy(nsp_logits.float(), batch["next_sentence_label"], reduction="sum")
    return mlm, nsp


def evaluate(net: nn.Module, examples: PretrainingExamples, vocab: Vocabulary, seed: int,
             batch_size: int) -> dict[str, float]:
    """Masked-LM and next-sentence loss and accuracy on held-out examples, exact over every rank: each
    rank evaluates its shard, and only the sums are collective. The masks are drawn for epoch 0 at
    every evaluation, so evaluations compare."""
    device = next(net.parameters()).device
    sums = dict.fromkeys(("mlm_loss", "mlm_right", "mlm_count", "nsp_loss", "nsp_right", "nsp_count"), 0.0)
    net.eval()
    with torch.no_grad():
        for indices in hsync.ShardSampler(len(examples), batch_size):
            batch = to_device(vocab.collate(examples, indices, seed, 0), device)
            mlm_logits, nsp_logits = pretraining_logits(net, batch)
            mlm_loss, nsp_loss = pretraining_losses(mlm_logits, nsp_logits, batch)
            labels, nsp_labels = batch["labels"], batch["next_sentence_label"]
            for key, value in (
                ("mlm_loss", mlm_loss),
                ("mlm_right", (mlm_logits.argmax(-1) == labels).sum()),  # never -100
                ("mlm_count", (labels != -100).sum()),
                ("nsp_loss", nsp_loss),
                ("nsp_right", (nsp_logits.argmax(-1) == nsp_labels).sum()),
                ("nsp_count", len(indices)),
            ):
                sums[key] += value  # tensors stay on the device: one read, by the reduction, not one per batch
    net.train()
    total = hsync.sum_over_ranks(sums)
    return {"valid_loss": total["mlm_loss"] / total["mlm_count"] + total["nsp_loss"] / total["nsp_count"],
            "valid_mlm_loss": total["mlm_loss"] / total["mlm_count"],
            "valid_mlm_accuracy": total["mlm_right"] / total["mlm_count"],
            "valid_nsp_loss": total["nsp_loss"] / total["nsp_count"],
            "valid_nsp_accuracy": total["nsp_right"] / total["nsp_count"],
            "valid_examples": int(total["nsp_count"])}


def save_final_model(net: nn.Module, vocab: Vocabulary, preset: ModelPreset, final: Path) -> Path:
    """Collective: rank 0 writes the model and its tokenizer in Hugging Face's format (loadable by
    from_pretrained), replacing an earlier `final` whole only once the new one is complete."""
    problem = None
    if dist.get_rank() == 0:
        from transformers import BertTokenizerFast

        staging = final.with_name(final.name + ".tmp")
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            net.save_pretrained(staging)
            (staging / "vocab.txt").write_text("\n".join(vocab.tokens) + "\n", encoding="utf-8")
            # Read back from the folder, which every transformers version's constructor agrees on.
            tokenizer = BertTokenizerFast.from_pretrained(staging, do_lower_case=True,
                                                          model_max_length=preset.max_seq_len)
            tokenizer.save_pretrained(staging)
            # The old model is set aside, not deleted, until the new one is in place: a crash leaves one.
            retired = final.with_name(final.name + ".old")
            shutil.rmtree(retired, ignore_errors=True)
            if final.exists():
                final.replace(retired)
            staging.replace(final)
            shutil.rmtree(retired, ignore_errors=True)
        except OSError as error:
            problem = f"{type(error).__name__}: {error}"
    fail_together(problem, f"cannot save the model to {final}")
    return final

"""Distill a tiny Llama student from a tiny Llama teacher with a Hugging Face ``Trainer``.

The student's ``lm_head`` becomes an :class:`orda_tp.DistillationHead` (same weight Parameter, so
the student's tied embeddings stay tied), and :class:`DistillationTrainer` overrides
``Trainer.compute_loss``: it takes the student's and the frozen teacher's final hidden states
(the decoder output after the final norm, exactly what each model's ``lm_head`` reads), shifts them
and the labels by one position for next-token prediction, and asks the student's head for

    loss = student CE + kl_weight · T² · KL(teacher_T ‖ student_T)

averaged over the non-ignored tokens of the whole accumulated batch (``num_items_in_batch``),
without building the (tokens × vocab) logits.

Both models are built from configs (nothing is downloaded). It needs transformers and accelerate;
the tested versions, from the clone (``torch==2.13.0``: pip then pulls no CUDA build on a CPU machine)::

    pip install torch==2.13.0 -e . 'transformers==5.24.0' 'accelerate==1.15.0'

Run::

    python examples/hf_trainer_distill.py             # CPU, a few seconds after the imports

The same script runs data-parallel (the Trainer wraps the student in DDP)::

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_distill.py
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence

import torch
from torch import Tensor, nn

import orda_tp

try:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
except ImportError as error:  # not a dependency of orda_tp: say how to install it
    raise ImportError(
        "examples/hf_trainer_distill.py needs transformers and accelerate: "
        "pip install 'transformers==5.24.0' 'accelerate==1.15.0'"
    ) from error

VOCAB_SIZE = 512
SEQ_LEN = 16
PROMPT_LEN = 3  # the first PROMPT_LEN tokens of a sequence are context: label -100
PAD_TOKEN_ID = 0
FIRST_TOKEN_ID = 3  # ids 0..2 are pad / bos / eos; the sequences use the others
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")  # what compute_loss passes to the models
LOSS_OPTIONS: dict[str, object] = {
    "student_ce_weight": 1.0,
    "kl_weight": 1.0,
    "kl_temperature": 2.0,
    "kl_divergence": "forward",
    "teacher_ce_weight": 0.0,  # a frozen teacher: its CE is not part of the loss
}


# ---- models ------------------------------------------------------------------------------------


def tiny_llama(hidden_size: int, *, tie_word_embeddings: bool, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    """A 2-layer ``LlamaForCausalLM`` over :data:`VOCAB_SIZE` tokens, randomly initialized from ``seed``."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ_LEN,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


def build_teacher(dtype: torch.dtype = torch.float32, seed: int = 0) -> LlamaForCausalLM:
    """The teacher: hidden size 64, its own (untied) LM head."""
    return tiny_llama(64, tie_word_embeddings=False, dtype=dtype, seed=seed)


def build_student(dtype: torch.dtype = torch.float32, seed: int = 1) -> LlamaForCausalLM:
    """The student: hidden size 32, LM head tied to the input embeddings (head not yet replaced)."""
    return tiny_llama(32, tie_word_embeddings=True, dtype=dtype, seed=seed)


def install_distillation_head(model: LlamaForCausalLM, **loss_options: object) -> orda_tp.DistillationHead:
    """Replace ``model.lm_head`` by a :class:`orda_tp.DistillationHead` around the same weight
    Parameter (a weight tied to the embeddings stays tied; the state-dict key stays
    ``lm_head.weight``). Without ``labels`` the head returns logits, so ``model(input_ids).logits``
    and ``model.generate(...)`` work as before. Do this after any ``resize_token_embeddings``,
    which replaces an untied head by a new ``nn.Linear``."""
    head = orda_tp.DistillationHead.from_linear(model.lm_head, **loss_options)
    model.lm_head = head
    return head


def build_models(
    dtype: torch.dtype = torch.float32, loss_options: dict[str, object] | None = None
) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """``(teacher, student)``, the student's head replaced by a ``DistillationHead`` with
    ``loss_options`` (default :data:`LOSS_OPTIONS`)."""
    teacher = build_teacher(dtype)
    student = build_student(dtype)
    install_distillation_head(student, **(LOSS_OPTIONS if loss_options is None else loss_options))
    return teacher, student


# ---- data --------------------------------------------------------------------------------------


def make_example(length: int, start: int, stride: int) -> dict[str, Tensor]:
    """One right-padded sequence of :data:`SEQ_LEN` positions: ``length`` tokens counting up by
    ``stride`` from ``start`` (mod the usable vocabulary), then padding. Labels are the input ids,
    -100 on the prompt and on the padding."""
    usable = VOCAB_SIZE - FIRST_TOKEN_ID
    positions = torch.arange(SEQ_LEN)
    tokens = FIRST_TOKEN_ID + (start + stride * positions) % usable
    real = positions < length
    input_ids = torch.where(real, tokens, PAD_TOKEN_ID)
    labels = torch.where(real & (positions >= PROMPT_LEN), tokens, -100)
    return {"input_ids": input_ids, "attention_mask": real.long(), "labels": labels}


def make_dataset(
    num_examples: int = 256, *, lengths: Sequence[int] | None = None, seed: int = 0
) -> list[dict[str, Tensor]]:
    """Synthetic sequences (arithmetic progressions, so there is something to learn), as a list of
    dicts of ``input_ids`` / ``attention_mask`` / ``labels`` (each of :data:`SEQ_LEN` positions).
    ``lengths`` fixes each sequence's number of real tokens (then ``num_examples`` is ignored);
    by default about half the sequences are padded."""
    generator = torch.Generator().manual_seed(seed)
    if lengths is None:
        full = torch.rand(num_examples, generator=generator) < 0.5
        short = torch.randint(PROMPT_LEN + 2, SEQ_LEN, (num_examples,), generator=generator)
        lengths = torch.where(full, SEQ_LEN, short).tolist()
    starts = torch.randint(0, VOCAB_SIZE, (len(lengths),), generator=generator).tolist()
    strides = torch.randint(1, 8, (len(lengths),), generator=generator).tolist()
    return [make_example(n, start, stride) for n, start, stride in zip(lengths, starts, strides)]


# ---- the loss ----------------------------------------------------------------------------------


def final_hidden_states(model: nn.Module, model_inputs: dict[str, Tensor]) -> Tensor:
    """The (B, T, H) hidden states that ``lm_head`` reads in the model's own forward: the decoder
    output after the final norm.

    The call goes through ``model`` itself, not ``model.model``: under DDP, a forward that bypasses
    the DDP wrapper leaves the gradients unsynchronized across ranks, without an error. transformers
    ties ``hidden_states[-1]`` to the final-norm output (``capture_outputs(tie_last_hidden_states=
    True)``), and an empty ``logits_to_keep`` makes the model's own head compute no logits at all.
    """
    no_position = torch.empty(0, dtype=torch.long, device=model_inputs["input_ids"].device)
    outputs = model(**model_inputs, output_hidden_states=True, logits_to_keep=no_position, use_cache=False)
    return outputs.hidden_states[-1]


def next_token_rows(hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Hidden state at position t paired with the label at t + 1: ``(hidden[:, :-1], labels[:, 1:])``,
    as ``ForCausalLMLoss`` shifts them (positions whose label is -100, prompt and padding, are ignored)."""
    return hidden[:, :-1, :], labels[:, 1:]


class DistillationTrainer(Trainer):
    """A ``Trainer`` whose loss is the student's ``DistillationHead`` loss against a frozen teacher.

    Gradient accumulation (transformers 5.24, ``trainer.py``): before the micro-batches of an
    optimizer step run, ``_get_num_items_in_batch`` counts the prediction targets of all of them,
    ``labels[..., 1:] != -100`` for a causal LM (``_loss_shifts_labels``), summed over the data-parallel
    ranks when ``average_tokens_across_devices`` (the default). The count is made only when the
    model's forward takes ``**kwargs`` (``model_accepts_loss_kwargs``, true for the causal LMs of
    transformers) and is passed to every ``compute_loss`` call as ``num_items_in_batch``.
    ``compute_loss`` gives it to the head as ``num_valid_tokens``, so each micro-batch returns
    ``Σ_(its tokens) loss / N_step``, and the gradients that ``backward`` adds up over the micro-batches
    are those of the mean over all N_step tokens of the step, whatever each micro-batch holds.

    ``training_step`` must then not divide by ``gradient_accumulation_steps``; with
    ``loss_is_scaled_for_ga = None`` it decides "already scaled" exactly when
    ``model_accepts_loss_kwargs and num_items_in_batch is not None``, which is when this loss used
    the count. (When the count is None, the loss is the micro-batch's own mean and the Trainer
    divides it by the number of micro-batches, as it does for any model.) Accelerate's ``backward``
    adds no division: the Trainer builds its ``Accelerator`` with ``num_steps=1``.

    Data parallelism: DDP averages gradients over the W ranks, while ``N_step`` already counts the
    tokens of all ranks, so the loss is multiplied by W, as the base ``compute_loss`` does.
    """

    # None: "scaled for gradient accumulation" exactly when num_items_in_batch was given (see above).
    loss_is_scaled_for_ga: bool | None = None

    def __init__(self, *args: object, teacher: nn.Module, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.teacher = teacher.to(self.args.device).eval().requires_grad_(False)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Tensor],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | int | None = None,
    ) -> Tensor | tuple[Tensor, orda_tp.HeadOutput]:
        """``student CE + kl_weight · T² · KL`` over the batch's next-token predictions, divided by
        ``num_items_in_batch`` (the accumulated batch's count) when given, else by this batch's count.
        With ``return_outputs``, the second value is the head's output (loss and its components)."""
        model_inputs = {name: inputs[name] for name in MODEL_INPUTS if name in inputs}
        hidden, labels = next_token_rows(final_hidden_states(model, model_inputs), inputs["labels"])
        with torch.no_grad():
            teacher_hidden, _ = next_token_rows(final_hidden_states(self.teacher, model_inputs), inputs["labels"])
        teacher = orda_tp.TeacherHead(teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), self.teacher.lm_head)
        head = self.accelerator.unwrap_model(model).lm_head
        out = head(hidden, labels=labels, teacher=teacher, num_valid_tokens=num_items_in_batch)
        loss = out.loss * self.data_parallel_scale(num_items_in_batch)
        return (loss, out) if return_outputs else loss

    def data_parallel_scale(self, num_items_in_batch: Tensor | int | None) -> int:
        """W when ``num_items_in_batch`` counts the tokens of all W data-parallel ranks (DDP then
        averages the W gradients), else 1; mirrors the end of ``Trainer.compute_loss``."""
        if num_items_in_batch is None or not self.args.average_tokens_across_devices:
            return 1
        return self.accelerator.num_processes // self.get_tp_size()


# ---- training ----------------------------------------------------------------------------------


def training_arguments(output_dir: str, **overrides: object) -> TrainingArguments:
    """CPU-friendly ``TrainingArguments``: no checkpoints, no reporting, no progress bars."""
    settings: dict[str, object] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": 16,
        "learning_rate": 3e-3,
        "lr_scheduler_type": "constant",
        "logging_steps": 10,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_cpu": not torch.cuda.is_available(),
        "seed": 0,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)  # type: ignore[arg-type]


def train_teacher(teacher: LlamaForCausalLM, dataset: list[dict[str, Tensor]], output_dir: str, steps: int) -> float:
    """Train the teacher with its own causal-LM loss (a plain ``Trainer``); return its last logged loss."""
    args = training_arguments(output_dir, max_steps=steps, logging_steps=steps)
    trainer = Trainer(model=teacher, args=args, train_dataset=dataset)
    trainer.train()
    return logged_losses(trainer)[-1]


def logged_losses(trainer: Trainer) -> list[float]:
    """The training losses the Trainer logged, in step order."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def distill(
    teacher: LlamaForCausalLM,
    student: LlamaForCausalLM,
    dataset: list[dict[str, Tensor]],
    output_dir: str,
    **overrides: object,
) -> DistillationTrainer:
    """Train ``student`` against the frozen ``teacher`` on ``dataset``; return the trainer."""
    trainer = DistillationTrainer(
        model=student, args=training_arguments(output_dir, **overrides), train_dataset=dataset, teacher=teacher
    )
    trainer.train()
    return trainer


def main(argv: Sequence[str] | None = None) -> None:
    """Train the teacher, distill the student, print the logged losses and a greedy continuation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=60, help="distillation optimizer steps")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # tiny models: one thread per process runs best on shared CPUs

    teacher, student = build_models()
    dataset = make_dataset()
    with tempfile.TemporaryDirectory() as output_dir:
        teacher_loss = train_teacher(teacher, dataset, output_dir, args.teacher_steps)
        trainer = distill(
            teacher,
            student,
            dataset,
            output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
        )
    if not trainer.is_world_process_zero():
        return
    print(f"teacher CE after {args.teacher_steps} steps: {teacher_loss:.4f}")
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    for entry in history:
        print(f"student step {entry['step']:4d} | loss {entry['loss']:.4f}")
    tied = student.lm_head.weight is student.get_input_embeddings().weight
    print(f"lm_head {type(student.lm_head).__name__}, tied to the embeddings: {tied}")
    prompt = dataset[0]["input_ids"][:PROMPT_LEN].unsqueeze(0).to(student.device)
    generated = student.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=PAD_TOKEN_ID)
    print(f"greedy continuation of {prompt[0].tolist()}: {generated[0, PROMPT_LEN:].tolist()}")
    print(f"summary: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")


if __name__ == "__main__":
    main()

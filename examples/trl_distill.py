"""On-policy distillation with TRL's ``DistillationTrainer``, its loss computed by orda_tp.

The student generates completions for the prompts, the frozen teacher scores them, and the loss
is TRL's generalized JSD(β) between their next-token distributions at ``temperature``, over the
completion tokens. :class:`orda_tp.integrations.trl.OrdaDistillationTrainer` is TRL's trainer with
that loss computed by orda_tp (the one line that changes); ``--compare`` trains again with TRL's
own loss from the same start and prints how far the two students ended apart.

Both models are tiny Llamas built from configs, with a word-level tokenizer built here (nothing is
downloaded); the teacher's config carries a ``logit_scale`` and the student's a
``final_logit_softcapping``, which TRL reads and hands to the loss. It needs trl (tested with
1.16.0, which pulls transformers, accelerate and datasets)::

    pip install torch==2.13.0 -e '.[trl]' 'trl==1.16.0' 'transformers==5.24.0' 'accelerate==1.15.0'

Run::

    python examples/trl_distill.py --compare          # CPU, a few seconds after the imports
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

try:
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import DistillationConfig, DistillationTrainer

    from orda_tp.integrations.trl import OrdaDistillationTrainer
except ImportError as error:  # not a dependency of orda_tp: say how to install it
    raise ImportError("examples/trl_distill.py needs trl: pip install 'trl==1.16.0'") from error

WORDS = [f"w{i}" for i in range(60)]
VOCAB_SIZE = 64  # 4 special tokens and the 60 words


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the 64 ids, padding on the left for generation."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{word: i + 4 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",
        truncation_side="left",
    )


def make_model(width: int, seed: int) -> LlamaForCausalLM:
    """A 2-layer Llama of hidden size ``width`` whose LM head has a bias."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.lm_head = torch.nn.Linear(width, VOCAB_SIZE, bias=True)
    return model


def train(trainer_class: type[DistillationTrainer], args: argparse.Namespace, out: str) -> tuple[list[Any], Any]:
    """``args.steps`` optimizer steps (2 micro-batches of 2 prompts each) of ``trainer_class`` from
    fixed initial weights: the logged steps and the student's parameters after them."""
    student, teacher = make_model(32, seed=0), make_model(48, seed=1)
    teacher.config.logit_scale = 1.5  # read by TRL's loss setup (Llama's own forward ignores it)
    student.config.final_logit_softcapping = 3.0
    prompts = [" ".join(WORDS[(7 * i + j) % 60] for j in range(3 + i % 4)) for i in range(4 * args.steps)]
    config = DistillationConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        logging_steps=1,
        learning_rate=1e-2,
        # SGD keeps the two runs' parameter differences as small as their gradients' (Adam divides them).
        optim="sgd",
        max_completion_length=6,
        beta=args.beta,
        temperature=args.temperature,
        generation_kwargs={"do_sample": False},
        seed=0,
        use_vllm=False,
        disable_dropout=True,
    )
    trainer = trainer_class(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=make_tokenizer(),
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logged, {name: value.detach().clone() for name, value in trainer.model.named_parameters()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--beta", type=float, default=0.5, help="0: KL(teacher‖student), 1: KL(student‖teacher)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--compare", action="store_true", help="train again with TRL's own loss and compare")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        logged, params = train(OrdaDistillationTrainer, args, out)
        for entry in logged:
            print(f"step {entry['step']}: loss {entry['loss']:.6g} entropy {entry['entropy']:.6g}")
        if args.compare:
            trl_logged, trl_params = train(DistillationTrainer, args, out)
            for entry in trl_logged:
                print(f"TRL's loss, step {entry['step']}: loss {entry['loss']:.6g} entropy {entry['entropy']:.6g}")
            largest = max((params[name] - value).abs().max().item() for name, value in trl_params.items())
            print(f"largest parameter difference after {args.steps} steps: {largest:.1e}")


if __name__ == "__main__":
    main()

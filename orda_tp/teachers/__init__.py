"""Teacher descriptors: where the teacher's logits come from, one class per kind.

- :class:`TiedTeacher`: the teacher shares the student's head, ``t = h_t Wᵀ``.
- :class:`SeparateTeacher`: the teacher has its own head, ``t = h_t W_tᵀ``.
- :class:`PrecomputedTeacher`: cached teacher outputs (logits, or hidden + head); never trained.
- :class:`TeacherHead`: a separate teacher given by its LM-head module rather than its weight
  (the call reads the weight as the module's forward would, gathering an FSDP2-sharded one).

Every descriptor is a :class:`TeacherSource`: what the loss needs to know of a teacher (its
tensors, their expected shapes, how a tensor-parallel call takes its shard, what its values must
satisfy, what it defaults to) is a method of the descriptor, so the rest of the library never
asks which kind it holds.
"""

from .cached import PrecomputedTeacher
from .source import (
    TEACHER_MODES,
    ExpectedShape,
    SeparateTeacher,
    ShardReader,
    TeacherHead,
    TeacherSource,
    TiedTeacher,
    ValueCheck,
)

Teacher = TiedTeacher | SeparateTeacher | PrecomputedTeacher
"""The descriptors a call reads tensors from (a :class:`TeacherHead` becomes a SeparateTeacher)."""

__all__ = [
    "TEACHER_MODES",
    "ExpectedShape",
    "PrecomputedTeacher",
    "SeparateTeacher",
    "ShardReader",
    "Teacher",
    "TeacherHead",
    "TeacherSource",
    "TiedTeacher",
    "ValueCheck",
]

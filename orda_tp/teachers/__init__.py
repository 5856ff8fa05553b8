"""Teacher descriptors, one class per kind of teacher (:class:`TiedTeacher`, :class:`SeparateTeacher`,
:class:`PrecomputedTeacher`, :class:`TeacherHead`, :class:`TeacherMixture`). Each is a
:class:`TeacherSource`, whose methods answer all the loss asks of a teacher, so the rest of the
library never asks which kind it holds."""

from .cached import PrecomputedTeacher
from .mixture import TeacherMixture
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
    "TeacherMixture",
    "TeacherSource",
    "TiedTeacher",
    "ValueCheck",
]

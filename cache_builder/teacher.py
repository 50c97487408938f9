"""The teacher runner lives in pipeline.teacher (the trainer's inline mode shares it); re-exported here."""
from pipeline.teacher import Teacher, TeacherError  # noqa: F401

"""Stages: pure prompt rendering and output validation; the runner does the I/O."""

from etl.stages.base import Outputs, Predicate, Stage
from etl.stages.classify import Classify, LabelIn, label_in
from etl.stages.extract import Extract
from etl.stages.plan import StagePlan
from etl.stages.routing import Router

__all__ = ["Classify", "Extract", "LabelIn", "Outputs", "Predicate", "Router", "Stage", "StagePlan", "label_in"]

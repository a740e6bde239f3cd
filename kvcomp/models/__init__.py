"""Model loading and architecture summaries."""

from kvcomp.models.loading import DTYPES, load_model, model_summary

__all__ = ["DTYPES", "load_model", "model_summary"]

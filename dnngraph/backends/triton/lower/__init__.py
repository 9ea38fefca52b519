"""Lowering: one builder per family turns a fused group into launches (render, load, bind)."""

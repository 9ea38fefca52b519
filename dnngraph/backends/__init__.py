"""Backends: one folder per kernel language. Each turns a group's problem into kernels: it says
which problems it supports, offers candidate configs with a cost estimate, and renders source."""

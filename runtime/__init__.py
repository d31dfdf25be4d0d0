"""The runtime: loads artifacts and generates text. Imports TVM's runtime only (no torch, no compiler)."""

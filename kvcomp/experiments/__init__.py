"""Published results that experiments are compared with (plain data, no model code)."""

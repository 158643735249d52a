"""Model layers in dependency order: norm, rope, linear, mhc, attention, moe."""

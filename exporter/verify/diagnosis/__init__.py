"""Where a failure comes from: debug graphs exposing every layer, and the first layer that diverges."""

"""The run's model: its spec (and the faults a spec may inject), its lifecycle table, its launch
layout, its timeline of interruptions and detections, and its status. Records, no decisions."""

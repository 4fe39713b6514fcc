"""Publishing a generation: its folders, a resumed attempt's rows, the gates, the table, the manifest (last)."""

"""Tool calling: the formats model families write calls in (formats) and the incremental parser that reads them (parser)."""

"""Pure functions (no nn.Module); each op in quadratic, chunked and step forms that tests hold equal."""

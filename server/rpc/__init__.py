"""How a call enters: credentials and roles, request parsing, and the admission of calls to
handler threads."""

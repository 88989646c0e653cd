"""Small plugins that exercise discovery: each module is one entry point of the tests."""

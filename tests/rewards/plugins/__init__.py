"""Small reward plugins that the tests load by "module:function" reference."""

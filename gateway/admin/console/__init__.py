"""The console (docs/console.md): web pages for a platform team on the admin listener, behind admin tokens."""

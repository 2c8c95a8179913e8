// Package config reads hostd's HCL configuration. Every error names the file
// and line (HCL diagnostics), and unknown attributes and blocks are errors,
// so a typo never silently falls back to a default. docs/config.md is the
// reference.
package config

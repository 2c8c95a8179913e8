// Package policy decides, per flow, whether a connection that the firewall
// already allowed may take the shared-memory fast path, and with what ring
// size. It is a pure pipeline:
//
//	Spec (parsed from HCL, or built in code)
//	  -> Compile (validates; every error names the rule and, from a file,
//	     the line)
//	  -> *Table (immutable; Decide is lock-free and safe for concurrent use)
//
// hostd keeps the current Table behind an atomic pointer and swaps it on
// reload; a reload that no longer allows a live flow revokes it.
//
// Policy never widens what the kernel allows: it only chooses between the
// fast path and plain TCP for connections that already exist.
package policy

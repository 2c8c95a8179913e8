//go:build !linux

package ruleset

import (
	"context"
	"errors"
)

// Watch is Linux-only.
func Watch(ctx context.Context, netnsPath, ignore string, changed func()) error {
	return errors.New("ruleset watch: netfilter is Linux-only")
}

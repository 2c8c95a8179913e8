/* early: prints PASS if early_lib's constructor could read and write. */
#include <stdio.h>

extern int early_ok;

int main(void)
{
	puts(early_ok ? "PASS early" : "FAIL early: the constructor's read/write failed");
	return !early_ok;
}
